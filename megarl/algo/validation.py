"""Validation scores from the rewards of ``n`` samples per held-out prompt, in verl's names.

``val-core/<data_source>/reward/mean@<n>`` is the number to watch: the mean reward over every
sample. With ``n > 1`` the spread within a prompt's samples shows under ``val-aux/``, for each
``k`` in 2, 4, 8, ... below ``n`` and ``n`` itself, as verl reports it:

- ``reward/{best,worst}@<k>/{mean,std}``: the best / worst reward among ``k`` of the prompt's
  samples, estimated by bootstrap (``k`` drawn with replacement, :data:`BOOTSTRAP_DRAWS`
  times); ``mean`` and ``std`` over the draws, each averaged over prompts.
- ``reward/maj@<k>/{mean,std}``: the reward of the majority answer among ``k`` drawn samples
  (majority voting, ties to the answer drawn first), where the reward can say what each
  response answered.
- ``pass@<k>``: the chance that at least one of ``k`` samples is right (reward 1), by the
  unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)`` for ``c`` right of
  ``n``; and ``reward/std@<n>``, the spread of the rewards within a prompt.

The draws come from a generator of their own (:data:`BOOTSTRAP_SEED`), so validation never
moves the training run's random streams. Pure Python and NumPy: plain lists in, floats out.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

FULL_REWARD = 1.0
"""A sample at this reward (or above) counts as solved for ``pass@<k>``."""
BOOTSTRAP_DRAWS = 1000
"""Bootstrap draws per prompt and ``k`` (verl's default)."""
BOOTSTRAP_SEED = 42
"""Seed of the bootstrap's own generator (verl's default)."""


def subset_sizes(n: int) -> list[int]:
    """The ``k`` reported for ``n`` samples: the powers of two from 2 below ``n``, then ``n``."""
    sizes = [k for k in (2**i for i in range(1, n.bit_length())) if k < n]
    return [*sizes, n] if n > 1 else []


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Chen et al. (2021), eq. 1 per problem: ``1 - C(n - c, k) / C(n, k)``."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def bootstrap_best_worst_maj(
    rewards: Sequence[float],
    answers: Sequence[str | None] | None,
    k: int,
    rng: np.random.Generator,
    draws: int = BOOTSTRAP_DRAWS,
) -> dict[str, tuple[float, float]]:
    """``{"best": (mean, std), "worst": ..., "maj": ...}`` over ``draws`` subsets of ``k`` of
    one prompt's samples drawn with replacement (``maj`` only with ``answers``)."""
    values = np.asarray(rewards, dtype=np.float64)
    picks = rng.integers(0, len(values), size=(draws, k))
    drawn = values[picks]
    out = {
        "best": _mean_std(drawn.max(axis=1)),
        "worst": _mean_std(drawn.min(axis=1)),
    }
    if answers is not None:
        majority = [_majority_reward(row, answers, values) for row in picks]
        out["maj"] = _mean_std(np.asarray(majority))
    return out


def _majority_reward(picks: np.ndarray, answers: Sequence[str | None], rewards: np.ndarray):
    """The reward of a sample that gave the most common answer among ``picks``."""
    votes = Counter(answers[i] for i in picks)
    winner, _ = votes.most_common(1)[0]
    return next(rewards[i] for i in picks if answers[i] == winner)


def _mean_std(values: np.ndarray) -> tuple[float, float]:
    return float(values.mean()), float(values.std())


def validation_metrics(
    data_sources: Sequence[str],
    rewards: Sequence[Sequence[float]],
    response_lens: Sequence[int],
    answers: Sequence[Sequence[str | None]] | None = None,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, float]:
    """Scores per data source from ``rewards[p]``, the ``n`` samples' rewards of prompt ``p``.

    Args:
        data_sources: One per prompt (``""`` is reported as ``unknown``).
        rewards: One list of ``n`` rewards per prompt; every prompt has the same ``n``.
        response_lens: Every sample's response length, for ``val-aux/response_length/mean``.
        answers: Like ``rewards``, the answer each sample gave (None: none found), for
            ``maj@k``; a source where no sample has one reports no ``maj``.
        seed: The bootstrap generator's seed.
    """
    if len(data_sources) != len(rewards):
        raise ValueError(f"{len(data_sources)} data sources for {len(rewards)} prompts")
    sizes = {len(samples) for samples in rewards}
    if len(sizes) > 1 or 0 in sizes:
        raise ValueError(f"every prompt needs the same number (>= 1) of samples, got {sizes}")
    by_source: dict[str, list[int]] = defaultdict(list)
    for index, source in enumerate(data_sources):
        by_source[source or "unknown"].append(index)
    rng = np.random.default_rng(seed)
    metrics: dict[str, float] = {}
    for source, prompts in sorted(by_source.items()):
        n = len(rewards[prompts[0]])
        metrics[f"val-core/{source}/reward/mean@{n}"] = statistics.fmean(
            statistics.fmean(rewards[p]) for p in prompts
        )
        if n > 1:
            metrics.update(_spread_metrics(source, prompts, rewards, answers, n, rng))
    if response_lens:
        metrics["val-aux/response_length/mean"] = statistics.fmean(response_lens)
    return metrics


def _spread_metrics(
    source: str,
    prompts: Sequence[int],
    rewards: Sequence[Sequence[float]],
    answers: Sequence[Sequence[str | None]] | None,
    n: int,
    rng: np.random.Generator,
) -> dict[str, float]:
    """The ``val-aux/`` metrics of one data source's prompts, ``n > 1`` samples each."""
    aux = f"val-aux/{source}/reward"
    said = answers  # maj@k only where some sample of this source said an answer
    if said is not None and all(a is None for p in prompts for a in said[p]):
        said = None
    metrics = {f"{aux}/std@{n}": statistics.fmean(statistics.pstdev(rewards[p]) for p in prompts)}
    for k in subset_sizes(n):
        per_prompt = [
            bootstrap_best_worst_maj(rewards[p], None if said is None else said[p], k, rng)
            for p in prompts
        ]
        for name in per_prompt[0]:
            metrics[f"{aux}/{name}@{k}/mean"] = statistics.fmean(s[name][0] for s in per_prompt)
            metrics[f"{aux}/{name}@{k}/std"] = statistics.fmean(s[name][1] for s in per_prompt)
        metrics[f"val-aux/{source}/pass@{k}"] = statistics.fmean(
            pass_at_k(n, sum(r >= FULL_REWARD for r in rewards[p]), k) for p in prompts
        )
    return metrics


def is_validation_step(step: int, total_steps: int, interval: int) -> bool:
    """Every ``interval`` steps and after the last one (verl's ``test_freq``); 0 = never."""
    return interval > 0 and (step % interval == 0 or step == total_steps)


def validates_before_training(val_before_train: bool, resumed_step: int) -> bool:
    """Whether ``trainer.val_before_train`` validates the weights the run starts from, logged
    as step 0 (``resumed_step`` = the checkpoint's step, 0 for a fresh start).

    A fresh start only. verl validates again after a resume and logs it at the checkpoint's
    step; here that step already has its record in ``metrics.jsonl``, TensorBoard and the wandb
    run the resume continues, and a second record of it would replace the first on the next
    resume (one line per step is kept), be hidden from TensorBoard's curves with the step's
    training values (``purge_step``), or be dropped by wandb (its steps only go forward).
    """
    return val_before_train and resumed_step == 0
