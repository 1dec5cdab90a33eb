"""Optimizer steps: the baseline mini-batches each ``optimizer.step()`` covers, and its normaliser.

The mode (``PlannerInputs.mode``) decides the steps of one epoch; every epoch repeats them.
A step's loss divides by the *unpruned* count of what it covers (:func:`normaliser_of`), so
pruning (:mod:`megarl.planner.pruning`) and the cut into micro-batches
(:mod:`megarl.planner.micro_batches`) never change the gradient's scale.

Modes:

* ``off`` -- the baseline. Mini-batch ``m`` is the contiguous index block
  ``[m * N / M, (m + 1) * N / M)`` (``M = ppo_mini_batches``; contiguous so GRPO groups stay
  together), the same in every epoch; every sequence is trained; one optimizer step per
  mini-batch and epoch, normaliser = that mini-batch's count.
* ``match_loss_curve`` -- the same optimizer steps as ``off`` (epochs x mini-batches, same
  membership, same normaliser), but only sequences with a non-zero advantage are trained. A
  mini-batch with no kept sequence becomes a *ghost step*: no micro-batch on any rank, yet the
  trainer still calls ``optimizer.step()`` on zero gradients, so Adam's moments and step count
  (and weight decay and the LR schedule) advance exactly as in the baseline. With exact pruning
  this reproduces the baseline's parameters up to floating-point summation order.
* ``fast`` -- fewer, fuller optimizer steps. Each epoch, consecutive baseline mini-batches are
  merged greedily into *runs*: a run grows while its kept (seq) tokens stay within one average
  baseline mini-batch, ``total_seq_tokens / M`` (a run always takes at least one mini-batch with
  a kept sequence, so an over-full single mini-batch is still a valid run). Greedy next-fit gives
  the fewest such contiguous runs: one step per epoch whenever the kept tokens fit, never more
  than ``M``. Each run is trained as one optimizer step whose normaliser is the unpruned count of
  the union of its mini-batches. Only when every sequence is pruned is the single run a ghost
  step (so ``ppo_mini_batches == 1`` stays exact even then).

  What ``fast`` approximates. With ``ppo_mini_batches == 1`` there is one run per epoch with the
  unpruned batch's normaliser: identical to ``match_loss_curve`` and thus exact. With ``M > 1``
  and ``S < M`` runs, each step is *exactly* the baseline loss of a coarser mini-batch partition
  (the union of the merged mini-batches, pruned) -- i.e. it is the baseline with larger
  mini-batches, not with the same ones. The normaliser is the union's unpruned count rather
  than, say, one mini-batch's: this keeps the gradient of every step a per-token (per-sequence)
  mean at the baseline's scale, so Adam's second-moment estimates stay consistent from step to
  step and across modes. The cost is fewer Adam steps: per epoch the model moves ``S`` steps of
  the coarser mean gradient instead of ``M`` steps of finer ones (for SGD, ``S/M`` of the
  first-order displacement; for Adam, whose step size is set by the learning rate, roughly the
  same ratio). Matching the baseline's displacement would need the LR scaled by ``M / S``, which
  is left to the user; the plan reports ``S`` and ``M`` so it can be logged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megarl.planner.inputs import LOSS_AGG_MODES, BatchArrays, PlannerError, PlannerInputs


def mini_batch_slices(num_sequences: int, ppo_mini_batches: int) -> tuple[tuple[int, ...], ...]:
    """The baseline mini-batches: contiguous index blocks, so GRPO groups stay together.

    The planner's ``off`` steps cover exactly these; the pass gates read the same slices.
    """
    size = num_sequences // ppo_mini_batches
    return tuple(tuple(range(m * size, (m + 1) * size)) for m in range(ppo_mini_batches))


def optimizer_runs(inputs: PlannerInputs, batch: BatchArrays) -> list[tuple[int, ...]]:
    """The baseline mini-batches each optimizer step of one epoch covers."""
    num_mini_batches = inputs.ppo_mini_batches
    if inputs.mode != "fast":
        return [(m,) for m in range(num_mini_batches)]
    kept_seq_tokens = np.where(batch.kept, batch.seq_tokens, 0)
    kept_per_mini_batch = kept_seq_tokens.reshape(num_mini_batches, -1).sum(axis=1)
    return merge_into_runs(
        kept_per_mini_batch.tolist(), int(batch.seq_tokens.sum()), num_mini_batches
    )


def merge_into_runs(
    kept_tokens_per_mini_batch: Sequence[int], total_tokens: int, num_mini_batches: int
) -> list[tuple[int, ...]]:
    """Fewest runs of consecutive mini-batches whose kept tokens fit ``total / num_mini_batches``.

    Greedy next-fit, which is optimal for contiguous runs. A run is only closed by a mini-batch
    with kept tokens and only once it holds some itself, so mini-batches without kept tokens join
    the open run, a single over-full mini-batch is a valid run, and a run without kept tokens
    exists only when the whole batch has none.
    """
    runs: list[tuple[int, ...]] = []
    current: list[int] = []
    current_tokens = 0
    for mini_batch, tokens in enumerate(kept_tokens_per_mini_batch):
        overflows = (current_tokens + tokens) * num_mini_batches > total_tokens
        if current_tokens > 0 and tokens > 0 and overflows:
            runs.append(tuple(current))
            current, current_tokens = [], 0
        current.append(mini_batch)
        current_tokens += tokens
    runs.append(tuple(current))
    return runs


def normaliser_of(
    response_tokens: Sequence[int], loss_agg: str, loss_scale_factor: float = 1.0
) -> float:
    """The denominator of one optimizer step's loss over the sequences it covers, unpruned.

    The loss sums ``value * weight`` over every token of every micro-batch of every rank and
    divides by this, which equals the aggregation over the unsplit step:

    * ``token-mean``: the response tokens (weight 1 per token);
    * ``seq-mean-token-sum`` and ``seq-mean-token-mean`` (weight ``1 / own length``): the
      sequences;
    * ``seq-mean-token-sum-norm``: sequences x ``loss_scale_factor``, so the scale of a
      sequence's token sum never depends on how the step was cut into micro-batches.
    """
    if loss_agg not in LOSS_AGG_MODES:
        raise PlannerError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")
    if loss_agg == "token-mean":
        return float(sum(response_tokens))
    if loss_agg == "seq-mean-token-sum-norm":
        return float(len(response_tokens)) * loss_scale_factor
    return float(len(response_tokens))


def step_label(mode: str, run_index: int, run: tuple[int, ...]) -> str:
    """How the plan's reasons name a step: its mini-batch, or the mini-batches it merged."""
    if mode != "fast":
        return f"mini-batch {run_index}"
    return f"merged step {run_index} (mini-batches {run[0]}-{run[-1]})"
