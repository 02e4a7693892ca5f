"""megarl: Megatron-centric reinforcement learning for LLM post-training."""

from megarl.utils import quiet

__version__ = "0.1.0"

quiet.apply()  # in a process a megarl run started: its known third-party warnings dropped before any import of them
