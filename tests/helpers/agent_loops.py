"""The user agent loop of docs/agents.md, as a user writes it: the unit tests drive it with fake
engines, the integration tests with the HF engine and in training runs
(``rollout.agent.loop=agent_loops:TwoTurns``)."""

from __future__ import annotations

from megarl.agent import AgentLoop, Trajectory

OBSERVATION = "\nObservation: 42\n"
"""The one observation between the two generated turns."""


class TwoTurns(AgentLoop):
    """Two generated turns of up to 16 tokens around one observation."""

    async def run(self, sample, ctx):
        traj = Trajectory(sample.prompt_ids)
        traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=16))
        traj.add_observation(ctx.tokenizer.encode(OBSERVATION, add_special_tokens=False))
        traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=16))
        return traj
