"""The rollout engine as a Ray actor: generation and weight loading happen in its own process."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from megarl.config import Config
from megarl.config.validation import lora_targets
from megarl.rewards import build_reward, score
from megarl.rollout.agent import AgentLoop, OversamplingEnd, Trajectory, trajectories_to_batch
from megarl.rollout.base import Generation, ImageInputs, SamplingParams, stream_callbacks
from megarl.rollout.batching import prompt_images
from megarl.rollout.gateway_agents import GatewayAgents
from megarl.rollout.tools import build_tools
from megarl.workers.sync_checks import digests_of


def make_engine(cfg: Config, model_path: str, device: str, gpus: list[str] | None = None, hosts: list | None = None,
                sender_node: str | None = None):
    if cfg.rollout.engine == "hf":
        from megarl.rollout.hf import HFRolloutEngine
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return HFRolloutEngine(model_path, device=device, dtype=dtype, seed=cfg.trainer.seed,
                               fp32_lm_head=cfg.actor.fp32_lm_head,
                               record_routing=cfg.actor.router_replay == "rollout", adapters=_adapters(cfg))
    if cfg.rollout.engine == "sglang":
        import os

        import ray

        from megarl.config.validation import env_strings
        from megarl.rollout.sglang import SGLangRolloutEngine
        r = cfg.rollout
        # colocated: on the trainer's GPUs (`gpus`), SGLang gives its KV cache back between rollouts;
        # disaggregated: on the GPUs Ray gave this actor, or on server hosts (`hosts`), SGLang keeps its memory
        colocated = not r.sglang_gpus
        if not colocated and not hosts:
            gpus = [str(g) for g in ray.get_gpu_ids()]
        return SGLangRolloutEngine(model_path, tp=r.sglang_tp, gpus=gpus, colocated=colocated, hosts=hosts,
                                   sender_node=sender_node,
                                   mem_fraction=r.sglang_mem_fraction,
                                   weight_format=r.sglang_weight_format, log_dir=cfg.trainer.output_dir,
                                   batch_rows=(cfg.data.prompts_per_step + cfg.agent.oversample_groups) * r.n_samples,
                                   extra_args=tuple(r.sglang_args), deterministic=r.deterministic,
                                   # the asynchronous modes generate beside training: the KV cache stays
                                   release_kv=colocated and cfg.trainer.mode == "sync",
                                   dtype="float32" if cfg.actor.precision == "fp32" else "bfloat16",
                                   fp32_lm_head=cfg.actor.fp32_lm_head and cfg.actor.precision != "fp32",
                                   record_routing=cfg.actor.router_replay == "rollout",
                                   lora=(cfg.actor.lora.rank, sorted(lora_targets(cfg.actor.lora)))
                                   if _adapters(cfg) else None,
                                   env=env_strings(r.sglang_env),
                                   verify_dir=os.path.join(cfg.trainer.output_dir, "sglang_verify")
                                   if cfg.trainer.verify_weight_sync_every else None)
    raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: expected hf or sglang")


def _adapters(cfg: Config) -> bool:
    """Weight syncs send LoRA adapters (rollout.lora_sync=adapter), not the merged model."""
    return cfg.actor.lora.rank > 0 and cfg.rollout.lora_sync == "adapter"


class RolloutWorker:
    def __init__(self, cfg: Config, model_path: str, device: str, threads: int = 1, gpus: list[str] | None = None,
                 hosts: list | None = None, sender_node: str | None = None):
        """`hosts`: server hosts (megarl.workers.group.start_server_hosts / start_colocated_hosts), (actor, its
        number of servers, the GPUs they go on) each; `sender_node`: colocated on hosts, the node of the rank that
        sends the weights (SGLangRolloutEngine)."""
        torch.set_num_threads(threads)
        self.cfg, self.model_path, self.hosts = cfg, model_path, hosts or []
        self.engine = make_engine(cfg, model_path, device, gpus, hosts, sender_node)
        self.agent = None  # the agent loop and its tools, built on first use (agent.enabled)
        self.reward_fn = None  # over-sampling with dynamic sampling scores finished groups here

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[ImageInputs | None] | None = None) -> list[Generation]:
        return self.engine.generate(prompts, params, images)

    def generate_groups(self, prompts: list[list[int]], params: SamplingParams,
                        images: list[ImageInputs | None] | None = None):
        """generate()'s groups as each ends, (prompt index, its generations): a Ray streaming generator, whose items
        reach the caller while the rest generate (megarl.workers.group.stream_rollout)."""
        yield from self.engine.generate_groups(prompts, params, images)

    def rollout_agent(self, prompts: list[dict], groups: list[list[Trajectory]], params: SamplingParams,
                      needed: int | None = None, varied_rewards: bool = False):
        """Multi-turn conversations (megarl/rollout/agent.py) next to the engine, so turns cost no round
        trip to the driver. `groups[i]` are the conversations of `prompts[i]`; with `needed`, the
        rest are aborted once that many groups are finished (and, with varied_rewards, their rewards
        differ). Returns AgentLoop.run_groups' (finished, unfinished, rejected count)."""
        return self.run_agents(prompts, groups, params, needed, self.acceptance(prompts, varied_rewards))

    def rollout_agent_groups(self, prompts: list[dict], groups: list[list[Trajectory]], params: SamplingParams,
                             needed: int | None = None, varied_rewards: bool = False):
        """rollout_agent()'s groups as each is accepted, (index in `groups`, its conversations): a Ray streaming
        generator, as generate_groups. With `needed` (over-sampling), after the call: the finished groups that fill
        the batch in (fewer than `needed` were accepted), then an OversamplingEnd (the batch's order, the unfinished
        groups, the number rejected)."""
        accept, streamed = self.acceptance(prompts, varied_rewards), set()

        def run(on_group):
            def accepted(index: int, group: list[Trajectory]) -> None:
                streamed.add(index)
                on_group(index, group)
            return self.run_agents(prompts, groups, params, needed, accept, accepted)
        finished, unfinished, rejected = yield from stream_callbacks(run)
        if needed is not None:
            position = {id(group): i for i, group in enumerate(groups)}
            order = [position[id(group)] for group in finished[:needed]]  # the synchronous loop's finished[:want]
            yield from ((i, groups[i]) for i in order if i not in streamed)
            yield OversamplingEnd(order, unfinished, rejected)

    def run_agents(self, prompts: list[dict], groups: list[list[Trajectory]], params: SamplingParams,
                   needed: int | None, accept: Callable | None, on_group: Callable | None = None):
        """The agent loop's run_groups; gateway agents (agent.gateway.function or command) get the prompt rows too."""
        runner = self.agent_loop()
        rows = {"rows": prompts} if isinstance(runner, GatewayAgents) else {}
        return runner.run_groups(groups, params, needed, accept, on_group, images=prompt_images(prompts), **rows)

    def agent_counts(self) -> dict:
        """Gateway agents' counts since the last call (GatewayAgents.take_counts); {} for the built-in loop."""
        return self.agent.take_counts() if isinstance(self.agent, GatewayAgents) else {}

    def acceptance(self, prompts: list[dict], varied_rewards: bool) -> Callable[[list[Trajectory]], bool] | None:
        """Over-sampling's test of a finished group: with varied_rewards, that its rewards differ (scored here, as
        megarl.algorithms.dapo.dynamic_sampling_filter judges them); None (every group counts) without."""
        if not varied_rewards:
            return None
        if self.reward_fn is None:
            self.reward_fn = build_reward(self.cfg.reward, self.cfg.data.task)
        tokenizer, r = self.agent_loop().tokenizer, self.cfg.reward

        def accept(group: list[Trajectory]) -> bool:
            batch = trajectories_to_batch(prompts, group, tokenizer.pad_token_id, tokenizer)
            rewards, _ = score(batch, self.reward_fn, r.timeout_s or None, r.num_workers)
            return len(group) == 1 or len(set(rewards)) > 1
        return accept

    def agent_loop(self) -> AgentLoop | GatewayAgents:
        """The agent loop and its tools, built on first use; a vision-language policy's with its image processor
        (its tools may answer with images). With agent.gateway.function or command: the user's agents and the
        OpenAI-compatible gateway they call (megarl/rollout/gateway_agents.py)."""
        if self.agent is None:
            from megarl.data.images import ImagePrompts
            from megarl.data.inputs import load_tokenizer  # its padding, the driver's (EOS where the model has none)

            tokenizer, d = load_tokenizer(self.model_path), self.cfg.data
            if self.cfg.agent.gateway.in_use:
                self.agent = GatewayAgents(self.engine, tokenizer, self.cfg.agent, Path(self.model_path).name)
                return self.agent
            images = ImagePrompts(self.model_path, tokenizer, d.min_pixels, d.max_pixels) \
                if (Path(self.model_path) / "preprocessor_config.json").exists() else None
            self.agent = AgentLoop(self.engine, tokenizer, build_tools(self.cfg.agent.tools), self.cfg.agent,
                                   image_prompts=images)
        return self.agent

    def begin_weight_update(self) -> list | None:
        """Start a sync: SGLang's endpoints, which the sending training rank sends its buckets to itself (CUDA IPC
        or NCCL, as each endpoint's transport says); None for engines loading buckets here (update_weights)."""
        begin = getattr(self.engine, "begin_weight_update", None)
        return begin() if begin is not None else None

    def end_weight_update(self, received: dict | None) -> None:
        """A training rank finished posting a sync itself (`received`: host copies of it, to verify)."""
        self.engine.end_weight_update(received)

    def update_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(bucket)

    def load_lora_adapter(self, path: str) -> None:
        """An adapter-only sync: the PEFT adapter directory `path` (written by training rank 0) for what follows."""
        self.engine.load_lora_adapter(path)

    def update_weight_shards(self, bucket: list[tuple[str, torch.Tensor]], gen_rank: int, gen_tp: int) -> None:
        if not hasattr(self.engine, "update_weight_shards"):
            raise NotImplementedError(f"{type(self.engine).__name__} takes full HF tensors only "
                                      "(rollout.weight_delivery=full)")
        self.engine.update_weight_shards(bucket, gen_rank, gen_tp)

    def weight_checksums(self) -> dict:
        return self.engine.weight_checksums()

    def weight_digests(self, dtypes: dict) -> dict:
        return digests_of(self.engine.named_weights(), dtypes)

    # partial rollouts around a weight update (megarl.rollout.partial), called while a generate runs (the
    # asynchronous modes' actor is threaded: megarl.workers.group.start_rollout)
    def pause_generation(self, partial: str) -> dict:
        return self.engine.pause_generation(partial)

    def resume_generation(self, version: int) -> None:
        self.engine.resume_generation(version)

    # colocated phases (megarl.workers.colocation)
    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_kv_cache(self) -> None:
        self.engine.resume_kv_cache()

    def resident_bytes(self) -> int | None:
        return self.engine.resident_bytes()

    def shutdown(self) -> None:
        """Stop the engine's servers before the actor goes (ray.kill would leave them running), then their hosts."""
        if self.agent is not None:  # its tools' processes, or the gateway's server
            self.agent.close()
        self.engine.shutdown()
        if self.hosts:
            import ray

            for host, _, _ in self.hosts:
                ray.kill(host)
