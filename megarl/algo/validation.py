"""Validation scores from the rewards of ``n`` samples per held-out prompt, in verl's names.

``val-core/<data_source>/reward/mean@<n>`` is the number to watch: the mean reward over every
sample. With ``n > 1`` the spread within a prompt's samples shows as ``val-aux/<data_source>/
reward/{best,worst}@<n>/mean`` (the best / worst sample per prompt, averaged over prompts),
``std@<n>`` and ``pass@<n>`` (the fraction of prompts with at least one sample at the full
reward of 1, meaningful for right/wrong rewards). Pure Python: plain lists in, floats out.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

FULL_REWARD = 1.0
"""A sample at this reward (or above) counts as solved for ``pass@<n>``."""


def validation_metrics(
    data_sources: Sequence[str],
    rewards: Sequence[Sequence[float]],
    response_lens: Sequence[int],
) -> dict[str, float]:
    """Scores per data source from ``rewards[p]``, the ``n`` samples' rewards of prompt ``p``.

    Args:
        data_sources: One per prompt (``""`` is reported as ``unknown``).
        rewards: One list of ``n`` rewards per prompt; every prompt has the same ``n``.
        response_lens: Every sample's response length, for ``val-aux/response_length/mean``.
    """
    if len(data_sources) != len(rewards):
        raise ValueError(f"{len(data_sources)} data sources for {len(rewards)} prompts")
    sizes = {len(samples) for samples in rewards}
    if len(sizes) > 1 or 0 in sizes:
        raise ValueError(f"every prompt needs the same number (>= 1) of samples, got {sizes}")
    by_source: dict[str, list[Sequence[float]]] = defaultdict(list)
    for source, samples in zip(data_sources, rewards, strict=True):
        by_source[source or "unknown"].append(samples)
    metrics: dict[str, float] = {}
    for source, prompts in sorted(by_source.items()):
        n = len(prompts[0])
        metrics[f"val-core/{source}/reward/mean@{n}"] = statistics.fmean(
            statistics.fmean(samples) for samples in prompts
        )
        if n > 1:
            aux = f"val-aux/{source}/reward"
            metrics[f"{aux}/std@{n}"] = statistics.fmean(statistics.pstdev(s) for s in prompts)
            metrics[f"{aux}/best@{n}/mean"] = statistics.fmean(max(s) for s in prompts)
            metrics[f"{aux}/worst@{n}/mean"] = statistics.fmean(min(s) for s in prompts)
            metrics[f"val-aux/{source}/pass@{n}"] = statistics.fmean(
                float(max(s) >= FULL_REWARD) for s in prompts
            )
    if response_lens:
        metrics["val-aux/response_length/mean"] = statistics.fmean(response_lens)
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
