"""The Megatron actor (and reference model) inside a rank process: build, forward, train.

Runs in every Megatron rank process; called by the rank loop (:mod:`megarl.trainer.rank_loop`).
May import models, algorithms, the planner's plan types and the batch types; never the trainer.
"""
