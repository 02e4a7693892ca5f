"""Weight transports into SGLang servers: cuda_ipc (colocated) and nccl_broadcast (disaggregated), the senders; the flat
bucket both pack (flat_bucket); megarl's loader that runs inside SGLang (sglang_loader)."""
