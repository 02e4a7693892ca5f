"""megarl: Megatron-centric reinforcement learning for LLM post-training."""

__version__ = "0.1.0"
