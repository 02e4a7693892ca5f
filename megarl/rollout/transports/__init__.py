"""Weight transports into SGLang servers, one per file: cuda_ipc (colocated), nccl_broadcast (disaggregated)."""
