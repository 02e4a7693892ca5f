"""Megatron engines: build the model and optimizer, run forward/backward over the pipeline schedule."""

__all__ = ["MegatronEngine"]


def __getattr__(name: str):
    # Lazy: the driver imports light modules of this package (packing) without loading megatron-core.
    if name == "MegatronEngine":
        from megarl.engine.megatron_engine import MegatronEngine
        return MegatronEngine
    raise AttributeError(f"module 'megarl.engine' has no attribute {name!r}")
