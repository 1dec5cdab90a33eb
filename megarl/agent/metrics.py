"""What a step's (or a validation's) agent trajectories report: turns, tool use, observation
length, truncation as trained, and the counters loops keep.

These are plain reductions over :class:`~megarl.agent.trajectory.Trajectory` values and counter
dicts, needed by three callers that share nothing else -- the batching driver
(:func:`megarl.agent.driver.agent_metrics` adds its engine-call figures), the asynchronous
rollout (a part's metrics without a driver step) and validation (``val-aux/`` names) -- so they
live apart from the driver's event loop and are unit-tested on plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megarl.agent.trajectory import Trajectory


def trajectory_metrics(
    trajectories: Sequence[Trajectory], max_response_tokens: int | None = None
) -> dict[str, float]:
    """What the trajectories themselves say: turns, tool use, observation length, truncation
    (means over trajectories, so equal-sized parts average to the whole's), as trained: a
    response over ``max_response_tokens`` (a loop that built it without the budget) is cut to
    it before training, so it counts as truncated and only its kept observation tokens count."""
    count = max(1, len(trajectories))
    turns = [t.num_turns for t in trajectories]
    kept = [_as_trained(t, max_response_tokens) for t in trajectories]
    return {
        "agent/num_turns/mean": sum(turns) / count,
        "agent/num_turns/max": float(max(turns, default=0)),
        "agent/tool_calls/mean": sum(t.tool_calls for t in trajectories) / count,
        "agent/tool_errors": float(sum(t.tool_errors for t in trajectories)),
        "agent/observation_tokens/mean": sum(observed for observed, _ in kept) / count,
        "agent/truncated_frac": sum(truncated for _, truncated in kept) / count,
    }


def _as_trained(traj: Trajectory, limit: int | None) -> tuple[int, bool]:
    """``traj``'s observation tokens and truncation once cut to ``limit`` response tokens."""
    if limit is None or len(traj.response_ids) <= limit:
        return traj.observation_tokens, traj.truncated
    return traj.response_mask[:limit].count(0), True


def validation_trajectory_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """A validation's agent metrics: turns under verl's ``val-aux/num_turns/{min,max,mean}``,
    the rest of :func:`trajectory_metrics` under ``val-aux/agent/``; empty when no agent loop
    ran (a single-turn validation reports none)."""
    if not trajectories:
        return {}
    turns = [t.num_turns for t in trajectories]
    metrics = {
        "val-aux/num_turns/min": float(min(turns)),
        "val-aux/num_turns/max": float(max(turns)),
        "val-aux/num_turns/mean": sum(turns) / len(turns),
    }
    for key, value in trajectory_metrics(trajectories).items():
        if not key.startswith("agent/num_turns/"):
            metrics[f"val-aux/{key}"] = value
    return metrics


def counter_metrics(counters: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The loops' counters (one dict per trajectory, :meth:`AgentContext.count
    <megarl.agent.driver.AgentContext.count>`) summed as ``agent/<name>``, by name, then the
    per-sample means of :func:`_per_sample_means`."""
    summed: dict[str, float] = {}
    for one in counters:
        for name, value in one.items():
            summed[name] = summed.get(name, 0.0) + value
    metrics = {f"agent/{name}": value for name, value in sorted(summed.items())}
    metrics.update(_per_sample_means(summed, len(counters)))
    return metrics


def _per_sample_means(counters: Mapping[str, float], samples: int) -> dict[str, float]:
    """Counters that read better as means: branches per sample, seconds per gateway request
    (their sums stay reported too)."""
    means = {}
    if "branches" in counters:
        means["agent/branches/mean"] = counters["branches"] / max(1, samples)
    if "gateway/latency_s" in counters:
        requests = max(1.0, counters.get("gateway/requests", 0.0))
        means["agent/gateway/latency_s/mean"] = counters["gateway/latency_s"] / requests
    return means
