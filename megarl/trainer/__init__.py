"""The training loop and the rollout host.

``rank_loop`` runs in every Megatron rank process; ``rollout_host``, ``rollout``, ``metrics``,
``summary`` (the end-of-run tables, also read by ``tools/summarize_run.py``), ``summary_plot``
(``summary.png``) and ``perf`` run where the rollout host lives (rank 0, or the rollout actor in
split placement); ``split_rollout`` holds the rollout actor and rank 0's proxy to it. Top of the
import order: nothing in megarl imports the trainer but start-up (:mod:`megarl.train`).
"""
