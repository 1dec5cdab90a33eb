"""Supervised fine-tuning on the RL stack (``algo.objective=sft``, ``recipe=sft``).

SFT here is the RL step with the rollout replaced by a dataset: each step's batch is
``data.prompts_per_step`` conversations (:mod:`megarl.sft.conversations`: token ids rendered
as the agent loops render them, a mask on the assistant's tokens), every sequence with
advantage 1 and the ``sft`` policy loss ``-A * log pi`` (:mod:`megarl.algo.policy_losses`), so
``token-mean`` over the masked tokens is the SFT cross-entropy. Everything else is the RL
machinery as it is: the planner's DP balancing and token-budget micro-batches (exact under any
split, tested), packing, TP/PP/DP/EP, LoRA, bf16, checkpoints and exact resume (the data
stream's position is in the checkpoint), Ray and Slurm. There is no rollout engine: the gates
skip the weight sync and say why. Validation is the loss and perplexity on ``data.val_files``.
The batches are made by :mod:`megarl.trainer.sft_batches`.
"""
