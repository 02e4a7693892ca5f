"""Training and rollouts on the same devices, one phase holding the memory at a time.

The colocated cycle of one RL step (trainer.offload_between_phases), as RLTrainer drives it:
  training done -> the rollout engine takes its weights memory back and the policy is synced into it
  (RLTrainer.sync_weights) -> to_rollout(): every training engine (the policy with its KL reference,
  the critic, the reward model) frees its weights, grads and optimizer state, copying to host memory
  only what cannot be re-made (MegatronEngine.offload: not the grads, nor bf16 weights with fp32
  master copies), and the rollout engine resumes its KV cache -> rollouts -> to_training():
  the rollout engine releases all its memory (weights too: it keeps no copy, the next sync refills
  them) and the training engines come back (MegatronEngine.onload: weights and optimizer state bit
  for bit; gradient buffers as fresh memory, which every update zeroes first).
A checkpoint written during the rollout phase onloads the engines for its duration (engine/checkpoint.py).
"""

from __future__ import annotations

import time

from megarl.workers.group import call_rollout, get_all


class Colocation:
    def __init__(self, groups: list, rollout, enabled: bool, timeout: float = 0.0):
        """groups: the TrainGroups (policy, critic, reward model); rollout: the RolloutWorker actor; timeout: the
        deadline of every call on the rollout actor (trainer.worker_timeout_s; the groups have their own)."""
        self.groups, self.rollout, self.enabled, self.timeout = groups, rollout, enabled, timeout
        self.phase = "training"

    def to_rollout(self) -> dict:
        """Training engines to host memory, the rollout engine's KV cache back; memory metrics."""
        if not self.enabled or self.phase == "rollout":
            return {}
        moved = [report for group in self.groups for report in group.call("offload")]
        metrics = self.memory("offloaded")
        start = time.perf_counter()  # the last stretch to a rollout engine ready to generate, after a sync
        call_rollout(self.rollout, "resume_kv_cache", timeout=self.timeout)
        metrics["timing/resume_kv_cache"] = time.perf_counter() - start
        self.phase = "rollout"
        # freed: all the engines' state; copied to the host and back: what cannot be re-made (offload.py)
        return metrics | self.memory("kv_cache") | {"memory/offloaded_gb": sum(r["freed"] for r in moved) / 1e9,
                                                    "memory/offload_bytes": sum(r["copied"] for r in moved)}

    def to_training(self) -> dict:
        """The rollout engine releases its memory, the training engines come back; memory metrics."""
        if not self.enabled or self.phase == "training":
            return {}
        call_rollout(self.rollout, "release_memory", timeout=self.timeout)
        metrics = self.memory("released")
        for group in self.groups:
            group.call("onload")
        self.phase = "training"
        return metrics | self.memory("onloaded")

    def memory(self, label: str) -> dict:
        """GB held now: the policy's engine state on its first rank, the rollout engine's weights where it
        can tell, and on GPU that rank's allocator and the whole device (SGLang's share is the rest)."""
        if not self.enabled:
            return {}
        train, rollout = get_all([self.groups[0].workers[0].memory.remote(), self.rollout.resident_bytes.remote()],
                                 "memory", ("policy rank 0", "the rollout actor").__getitem__, self.timeout)
        out = {f"memory/{label}/train_{k}_gb": v / 1e9 for k, v in train.items()}
        if rollout is not None:
            out[f"memory/{label}/rollout_resident_gb"] = rollout / 1e9
        return out
