"""One training rank: a Ray actor that owns a MegatronEngine in its own torch.distributed process."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import socket
import time

import ray
import torch

from megarl.config import Config
from megarl.reshard.inventory import hf_inventory
from megarl.reshard.layout import GenLayout, new_generation_group, resharded_layout, sglang_generation
from megarl.reshard.plan import server_bytes
from megarl.reshard.transfers import transfer_bytes
from megarl.protocol import Batch
from megarl.rollout.sglang_layout import check_presharded_tower, check_presharded_vocab
from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
from megarl.utils import quiet
from megarl.utils.profiling import profiled
from megarl.workers import weight_sync
from megarl.workers.sync_checks import shard_key


# role -> (config section, engine head, trainable): the critic and the reward model are value heads; the reward
# model is frozen in RL and trained by python -m megarl.train_rm (reward_model_training)
ROLES = {"actor": ("actor", "lm", True), "critic": ("critic", "value", True),
         "reward_model": ("reward_model", "value", False), "reward_model_training": ("reward_model", "value", True)}


class TrainWorker:
    def __init__(self, rank: int, cfg: Config, model_path: str, device: str, role: str = "actor"):
        if role not in ROLES:
            raise ValueError(f"role={role!r}: expected one of {', '.join(ROLES)}")
        self.rank, self.cfg, self.model_path, self.device, self.role = rank, cfg, model_path, device, role
        torch.set_num_threads(cfg.trainer.threads_per_rank)
        if device == "cpu":
            from megarl.parallel.compat import install_cpu_compat
            install_cpu_compat()
            quiet.filter_gpu_advice()
        self.engine = None
        self.policy_sync = None  # weight_sync.PolicySync: the senders (CUDA IPC or NCCL), kept across syncs
        self.expected = {}  # (delivery, generation TP) -> weight_layout.ExpectedChecksums, kept across syncs
        self.generation_group = None  # sharded delivery: this rank's generation TP group, a CPU (gloo) group
        self.replicas = None  # sharded into SGLang: every rank's CPU group, over which all the groups post together
        self.planned_traffic = {}  # delivery -> this rank's bytes of a sync as the planner predicts them (`traffic`)
        self.policy_updates = 0  # train(loss="policy") calls so far: trainer.profile_update counts them
        self.adapter_syncs = 0  # rollout.lora_sync=adapter: the adapter directories written so far

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for torch.distributed's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int, total_steps: int) -> dict:
        from megarl.engine import MegatronEngine
        from megarl.parallel.state import init_parallel
        from megatron.core import parallel_state as mpu

        name, head, trainable = ROLES[self.role]
        section = getattr(self.cfg, name)
        p = section.parallel
        init_parallel(self.rank, p.world_size, master_addr, master_port, p.tp, p.pp, self.device,
                      self.cfg.trainer.seed, ep=p.ep, cp=p.cp, etp=p.etp or None)
        self.engine = MegatronEngine(self.model_path, section, self.cfg.algorithm, self.device,
                                     self.cfg.trainer.seed, total_steps, head=head, trainable=trainable,
                                     skip_nonfinite_updates=self.cfg.trainer.skip_nonfinite_updates)
        self.resharder = self._resharder() if self.role == "actor" else None
        return {"rank": self.rank, "dp_rank": mpu.get_data_parallel_rank(), "pid": os.getpid(),
                "node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def _resharder(self):
        """The policy's weight sync (megarl.reshard) for the layouts it models: TP x PP (contiguous stages, even
        or not) x DP, with EP and ETP for the experts; with virtual pipeline stages (interleaved layers), and with
        LoRA (the resharder moves the parameters as they are, not merged with the adapters), the sync falls back to
        export_hf_weights."""
        from megarl.reshard.resharder import engine_resharder

        if self.cfg.actor.parallel.vpp > 1 or self.engine.lora is not None:
            return None
        return engine_resharder(self.engine, self.rank)

    def served_layout(self, delivery: str) -> GenLayout:
        """How each engine holds the weights, as far as `delivery` needs it: for "sharded", rollout.sglang_tp ranks
        and into SGLang the expert parallelism rollout.sglang_args gives its servers (--ep-size: each rank whole
        experts of its slice; settings that place weights otherwise are refused, naming them); for "full", the TP
        alone (every engine rank receives whole tensors and keeps its own part)."""
        r = self.cfg.rollout
        if delivery == "sharded" and r.engine == "sglang":
            return sglang_generation(r.sglang_tp, r.sglang_args)
        return GenLayout(r.sglang_tp)

    def compute_logprobs(self, batch: Batch, with_entropy: bool = False, reference: bool = False,
                         with_sum_pi_squared: bool = False) -> Batch:
        with self.out_of_memory_hint():
            return self.engine.compute_logprobs(batch, with_entropy=with_entropy, reference=reference,
                                                with_sum_pi_squared=with_sum_pi_squared)

    def compute_values(self, batch: Batch) -> Batch:
        with self.out_of_memory_hint():
            return self.engine.compute_values(batch)

    def compute_rewards(self, batch: Batch) -> Batch:
        with self.out_of_memory_hint():
            return self.engine.compute_rewards(batch)

    def train(self, batch: Batch, loss: str = "policy", lr: float | None = None) -> dict[str, float]:
        started_at, profile = time.time(), None
        if loss == "policy":
            self.policy_updates += 1
            if self.policy_updates == self.cfg.trainer.profile_update:
                profile = os.path.join(self.cfg.trainer.output_dir, "profile",
                                       f"update_{self.policy_updates}_rank_{self.rank}")
        with self.out_of_memory_hint(), profiled(profile, self.device):
            start = time.perf_counter()
            metrics = self.engine.train(batch, loss=loss, lr=lr)
        if loss == "policy":  # the update inside this rank, beside the driver's timing/train around the call
            metrics |= {"engine_seconds": time.perf_counter() - start, "started_at": started_at}
        return metrics

    @contextlib.contextmanager
    def out_of_memory_hint(self):
        """A GPU out of memory in a forward or backward pass says which settings make room, by their config keys."""
        try:
            yield
        except torch.OutOfMemoryError as error:
            name = ROLES[self.role][0]
            section = getattr(self.cfg, name)
            ways = [f"fewer tokens per micro-batch ({name}.max_tokens_per_micro_batch="
                    f"{section.max_tokens_per_micro_batch}, {name}.micro_batch_size={section.micro_batch_size})"]
            if section.recompute == "none":
                ways.append(f"{name}.recompute=full (each layer's activations recomputed in the backward pass)")
            if self.cfg.sglang_colocated() and not self.cfg.offload_enabled(self.device):
                if self.cfg.trainer.mode == "sync":
                    ways.append(f"trainer.offload_between_phases=auto (now {self.cfg.trainer.offload_between_phases}:"
                                " SGLang keeps its weights on this GPU during training)")
                ways.append(f"a smaller rollout.sglang_mem_fraction (now {self.cfg.rollout.sglang_mem_fraction}, "
                            "SGLang's share of this GPU) or SGLang on GPUs of its own (rollout.sglang_gpus)")
            raise torch.OutOfMemoryError(f"{error}\nrank {self.rank} ({self.role}) ran out of GPU memory; what makes "
                                         f"room: {'; '.join(ways)}") from error

    def offload(self) -> dict[str, int]:
        return self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()

    def set_kl_coef(self, value: float) -> None:
        """The adaptive KL controller's new coefficient, for the KL term of the policy loss."""
        self.engine.algorithm = dataclasses.replace(self.engine.algorithm, kl_coef=value)

    def snapshot_reference(self) -> None:
        """Freeze the current policy as the KL reference (done once, after the warm start)."""
        self.engine.snapshot_reference()

    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes its part of the engine's dist checkpoint into `directory`."""
        self.engine.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> dict:
        """Every rank loads the engine from `directory` (written at any layout)."""
        return self.engine.load_checkpoint(directory)

    def push_weights(self, rollout, bucket_bytes: int, verify: bool, deep: bool = False) -> weight_sync.RankSync:
        """The policy's weights into the rollout engine (`_push_weights`). Where a colocated SGLang (synchronous
        mode) takes memory on this GPU next, the memory the allocator caches (the update's activations, this sync's
        temporary buffers) may have to go back to the device first. With the offload cycle, always, before the
        sync, for SGLang's weights (a 3B on one H200 held 108 GB of cached activations when SGLang took its 6 GB of
        weights back, and SGLang died). Without it, after the sync, for SGLang's KV cache, but only where the GPU
        lacks SGLang's share (rollout.sglang_mem_fraction) outside the cache: handed back every step, the cache is
        re-made by the next update, ~140 cudaMalloc calls at 0.5B."""
        if self.cfg.actor.lora.rank and self.cfg.rollout.lora_sync == "adapter":  # the trainer's rule, by config
            return self._push_adapter(rollout)
        colocated = self.device == "cuda" and self.cfg.sglang_colocated() and self.cfg.trainer.mode == "sync"
        offload = self.cfg.offload_enabled(self.device)
        if colocated and offload:
            torch.cuda.empty_cache()
        report = self._push_weights(rollout, bucket_bytes, verify, deep)
        if colocated and not offload:
            free, total = torch.cuda.mem_get_info()
            if free < self.cfg.rollout.sglang_mem_fraction * total:
                torch.cuda.empty_cache()
        return report

    def _push_weights(self, rollout, bucket_bytes: int, verify: bool, deep: bool) -> weight_sync.RankSync:
        """Every rank takes part in resharding. Full delivery: rank 0 sends whole HF tensors; sharded: each rank
        sends its own rows of its generation TP group (rollout.sglang_tp ranks; into SGLang at --ep-size, only the
        routed experts of its EP slice). The rollout engine picks the transport
        (weight_sync.PolicySync, weight_senders.sender_for): SGLang's endpoints, sent to from here by CUDA IPC
        (colocated) or NCCL broadcast (disaggregated), or the rollout actor. With `verify`, the checksums the rollout
        engine's parameters must have (weight_layout.ExpectedChecksums), or with `deep` too, digests of what was sent
        and host copies for SGLang's reload check. Sharded into SGLang: every generation TP group k packs its rows on
        its own GPUs and its first rank posts them to server k, the one on those GPUs (cuda_ipc.ShardedIpcSender;
        weight_sync.Sharding's `replicas`), so no rows leave their node; the first group's rows are what the sync is
        verified against. Sharded into the rollout actor's engine (the CPU's), the first group's ranks load theirs.
        Returns this rank's report (a sender's of the first group) and its traffic beside the planner's
        (`traffic`)."""
        delivery = self.cfg.rollout.weight_delivery
        gen = resharded_layout(self.served_layout(delivery), delivery)
        gen_tp = gen.tp
        if self.resharder is None:
            buckets = self.engine.export_hf_weights(bucket_bytes)
        else:
            buckets = self.resharder.buckets(gen, delivery, bucket_bytes, self.engine.params_dtype)
        into_sglang = self.cfg.rollout.engine == "sglang"
        if delivery == "sharded" and self.generation_group is None:  # the first sync, on every rank alike
            if into_sglang:  # refused before any collective, by every rank
                check_presharded_vocab(self.resharder.specs, gen_tp)
                check_presharded_tower(self.resharder.specs)
                self.generation_group = new_generation_group(self.resharder.train, gen, backend="gloo")
                self.replicas = torch.distributed.new_group(backend="gloo")
            else:
                self.generation_group = torch.distributed.new_group(list(range(gen_tp)), backend="gloo")
        first_group = self.rank < gen_tp
        if not first_group and (delivery == "full" or not into_sglang):  # take part in the collectives only
            for _ in buckets:
                pass
            return weight_sync.RankSync(None, self.traffic(delivery, None))
        # Sharded: rank 0 alone starts and ends the sync, and tells the others the endpoints
        talks = delivery == "full" or self.rank == 0
        verify = verify and first_group
        sharding = None if delivery == "full" else weight_sync.Sharding(
            self.generation_group, shard_key(self.resharder.specs, gen, self.rank), self.replicas,
            server=self.rank // gen_tp)
        side = actor_side(rollout, talks, None if delivery == "full" else (self.rank, gen_tp))
        if self.policy_sync is None:
            self.policy_sync = weight_sync.PolicySync(self.cfg.rollout.sglang_weight_format,
                                                      ray.util.get_node_ip_address())
        report = self.policy_sync.push(buckets, side, verify, sharding=sharding,
                                       expected=self.expected_checksums(delivery, gen_tp) if verify and not deep
                                       else None)
        # the first group's reports stand for the sync: its rows are every server's
        return weight_sync.RankSync(report if first_group else None, self.traffic(delivery, report.bytes))

    def _push_adapter(self, rollout) -> weight_sync.RankSync:
        """rollout.lora_sync=adapter: the adapters alone, gathered whole (every rank takes part), written by rank 0 as
        a PEFT directory under trainer.output_dir (which the rollout engine's node must read: a shared filesystem
        across nodes), which rank 0 has the rollout engine load; the previous sync's directory is then removed.
        Unverified (the report carries no checksums)."""
        from megarl.engine.lora_peft import save_peft

        start = time.perf_counter()
        self.adapter_syncs += 1
        # absolute: SGLang's servers resolve the path from a working directory of their own
        directory = os.path.join(os.path.abspath(self.cfg.trainer.output_dir), "lora_sync",
                                 f"policy_{self.adapter_syncs:06d}")
        nbytes = save_peft(self.engine, directory, self.model_path)
        if self.rank != 0:
            return weight_sync.RankSync(None, None)
        written = time.perf_counter()
        ray.get(rollout.load_lora_adapter.remote(directory))
        loaded = time.perf_counter()
        shutil.rmtree(os.path.join(os.path.dirname(directory), f"policy_{self.adapter_syncs - 1:06d}"),
                      ignore_errors=True)
        report = weight_sync.SyncReport(bytes=nbytes, direct=False, begin_s=0.0, gather_convert_s=written - start,
                                        pack_s=0.0, transfer_s=loaded - written, end_s=0.0,
                                        posts_s=[loaded - written], seconds=loaded - start)
        return weight_sync.RankSync(report, None)

    def save_peft(self, directory: str) -> None:
        """The policy's adapters as a PEFT directory (actor.lora.peft_dir; collective, rank 0 writes)."""
        from megarl.engine.lora_peft import save_peft

        save_peft(self.engine, directory, self.model_path)

    def traffic(self, delivery: str, sent: int | None) -> dict | None:
        """This rank's bytes of the last sync beside the planner's for the same layouts (megarl.reshard.plan):
        received and sent resharding among the training ranks, and what it sent (`sent`) to each engine rank it
        feeds (sharded: its own rank's; full, rank 0: every rank of a server gets the whole tensors). None without
        the resharder (virtual pipeline stages: megatron's export)."""
        if self.resharder is None:
            return None
        specs, train = self.resharder.specs, self.resharder.train
        if delivery not in self.planned_traffic:
            served, itemsize = self.served_layout(delivery), self.engine.params_dtype.itemsize
            recv, send = transfer_bytes(specs, train, resharded_layout(served, delivery), delivery, itemsize)
            if delivery == "sharded":  # into SGLang every group feeds its own server
                into_sglang = self.cfg.rollout.engine == "sglang"
                fed = [self.rank % served.tp] if self.rank < served.tp or into_sglang else []
            else:
                fed = list(range(served.tp)) if self.rank == 0 else []
            self.planned_traffic[delivery] = dict(plan_recv=recv[self.rank], plan_send=send[self.rank], plan_server=[
                server_bytes(specs, served, t, delivery, itemsize) for t in fed])
        planned = self.planned_traffic[delivery]
        return planned | dict(recv=self.resharder.received_bytes, send=self.resharder.sent_bytes,
                              server=[sent] * len(planned["plan_server"]))

    def expected_checksums(self, delivery: str, gen_tp: int) -> ExpectedChecksums:
        """What this rank's part of a sync must make the rollout engine's parameters hash to: full delivery, every
        engine TP rank's (rank 0 sends whole tensors, each SGLang rank keeps its shard); sharded, its own rank's.
        One per delivery, kept across syncs (its plans of where each tensor's pieces go are worked out once)."""
        if (delivery, gen_tp) not in self.expected:
            self.expected[(delivery, gen_tp)] = self._new_expected_checksums(delivery, gen_tp)
        return self.expected[(delivery, gen_tp)]

    def _new_expected_checksums(self, delivery: str, gen_tp: int) -> ExpectedChecksums:
        r = self.cfg.rollout
        specs = self.resharder.specs if self.resharder is not None else hf_inventory(self.engine.hf_config)
        layout = layout_for(specs, r.engine, r.sglang_tp, hf=self.engine.hf_config, sglang_args=r.sglang_args)
        if delivery == "full":
            return ExpectedChecksums(layout, list(range(layout.tp)))
        if r.engine != "sglang":  # the engine holds whole tensors: every rank's row blocks land in them
            return ExpectedChecksums(layout, [0], sender=(self.rank, gen_tp))
        return ExpectedChecksums(layout, [self.rank], presharded=True)

    def memory(self) -> dict[str, int]:
        """This rank's engine state on its device, and on GPU the allocator's and the whole device's use."""
        out = {"resident": self.engine.resident_bytes()}
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            out |= {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                    "device_used": total - free}
        return out

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy by HF name (every rank gathers; for tests and checks)."""
        return {n: t.clone() for bucket in self.engine.export_hf_weights(1 << 30) for n, t in bucket}

    def shutdown(self) -> None:
        """Weight groups first (the servers are still up: the trainer stops the rollout actor after the ranks)."""
        from megarl.parallel.state import destroy_parallel
        if self.policy_sync is not None:
            self.policy_sync.close()
        destroy_parallel()


def actor_side(rollout, talks: bool, shard: tuple[int, int] | None = None) -> weight_sync.RolloutSide:
    """The rollout actor `rollout` as a training rank reaches it for a sync (weight_sync.RolloutSide); `talks`: this
    rank starts and ends the sync; `shard` = (generation rank, generation TP): it loads that rank's rows."""
    def load(bucket):
        if shard is None:
            return functools.partial(ray.get, rollout.update_weights.remote(bucket))
        return functools.partial(ray.get, rollout.update_weight_shards.remote(bucket, *shard))

    return weight_sync.RolloutSide(
        begin=(lambda: ray.get(rollout.begin_weight_update.remote())) if talks else None,
        end=(lambda received: ray.get(rollout.end_weight_update.remote(received))) if talks else None, load=load)
