"""The rollout engine as a Ray actor: generation and weight loading happen in its own process."""

from __future__ import annotations

import torch

from megarl.config import Config
from megarl.rollout.base import Generation, SamplingParams
from megarl.workers import weight_sync


def make_engine(cfg: Config, model_path: str, device: str):
    if cfg.rollout.engine == "hf":
        from megarl.rollout.hf import HFRolloutEngine
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return HFRolloutEngine(model_path, device=device, dtype=dtype, seed=cfg.trainer.seed)
    if cfg.rollout.engine == "sglang":
        import os

        from megarl.rollout.sglang import SGLangRolloutEngine
        r = cfg.rollout
        # colocated with the trainer: SGLang gives its KV cache back between rollouts
        return SGLangRolloutEngine(model_path, tp=r.sglang_tp, colocated=True, mem_fraction=r.sglang_mem_fraction,
                                   weight_format=r.sglang_weight_format, log_dir=cfg.trainer.output_dir,
                                   verify_dir=os.path.join(cfg.trainer.output_dir, "sglang_verify")
                                   if cfg.trainer.verify_weight_sync else None)
    raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: expected hf or sglang")


class RolloutWorker:
    def __init__(self, cfg: Config, model_path: str, device: str, threads: int = 1):
        torch.set_num_threads(threads)
        self.engine = make_engine(cfg, model_path, device)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self.engine.generate(prompts, params)

    def update_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(bucket)

    def weight_digests(self, dtypes: dict[str, torch.dtype]) -> dict[str, str]:
        return weight_sync.digests_of(self.engine.named_weights(), dtypes)
