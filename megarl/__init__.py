"""megarl: RL post-training for LLMs on Megatron-Core."""

__version__ = "0.1.0"
