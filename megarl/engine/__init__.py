"""Megatron engines: build the model and optimizer, run forward/backward over the pipeline schedule."""

from megarl.engine.megatron_engine import MegatronEngine

__all__ = ["MegatronEngine"]
