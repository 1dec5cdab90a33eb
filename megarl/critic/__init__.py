"""PPO's critic: the Megatron value model and its update (the math is in megarl.algo.gae)."""
