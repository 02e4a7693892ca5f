"""Rollouts from real SGLang servers (GPU): one `python -m sglang.launch_server` process per generation
TP group, owned by this engine (the launch command, the server process and its HTTP client: sglang_server.py).

- generate(): token ids in, token ids and per-token log-probs out (SGLang's `output_token_logprobs`,
  under the raw logits as base.py requires at temperature 1), n samples per prompt, stop tokens.
  Prompts go to the least-loaded server (rows in flight), all n samples of a prompt to the same one
  (they share its prefix cache); a conversation id keeps a multi-turn conversation on one server.
- Partial rollouts (megarl/rollout/partial.py): pause_generation aborts the requests in flight (SGLang answers each
  with the tokens and log-probs it has so far) and holds new ones here, so the weight update finds no request
  holding SGLang's model-update lock; resume_generation re-submits them as prompt + tokens so far, with what is
  left of their budget and their own sampling seeds, and each token carries the policy version that produced it.
  (Not SGLang's own /pause_generation: its abort mode waits for the requests in 1 s polls, and its retract and
  in_place modes go on inside the server under the new weights without saying which tokens each version wrote.)
- A server that dies is restarted (by the injectable `launch`) and its requests retried: on another
  server holding the current policy when there is one; on the restarted server only while no policy
  was pushed (a restarted server holds its checkpoint weights: generating from them after a sync would
  silently be off-policy, so that raises until the next sync).
- Weights: full HF-named tensors per bucket (SGLang slices its own TP shard), or with
  rollout.weight_delivery=sharded each TP rank's own rows from the training rank on its GPU (presharded
  loading: transports/cuda_ipc.py ShardedIpcSender), sent by the trainer's sending rank(s) themselves
  between `begin_weight_update`, which hands out the endpoints and names their transport, and
  `end_weight_update`: CUDA IPC when colocated (transports/cuda_ipc.py), NCCL broadcast when
  disaggregated (transports/nccl_broadcast.py: the rank is rank 0 of a weight group with each server).
- Colocated memory: when a server has no rows in flight its KV cache is released (the trainer gets
  that memory back; `release_kv`: not in the asynchronous modes, which generate beside training); the next
  generate resumes it first and flushes the prefix cache if weights changed. release_memory() also drops the weights (SGLang keeps no copy): they must be pushed again.
- Verification inside SGLang (`verify_weights`): the weights SGLang received are snapshotted by its
  own weights checker, reset to noise, reloaded by SGLang's own loader from a file of the exported
  tensors, and compared by the checker; any difference fails with SGLang's message.
"""

from __future__ import annotations

import base64
import functools
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Callable, Iterable

import torch

from megarl.rollout.base import (Generation, GroupCollector, ImageInputs, RolloutEngine, SamplingParams, check_images,
                                 derive_seed)
from megarl.rollout.partial import GenerationGate, Row, Segment, generate_rows
from megarl.rollout.server_host import remote_servers
from megarl.rollout.sglang_images import image_item, placeholder_ban, request_image_data, vision_fields
from megarl.rollout.sglang_server import (Endpoint, SGLangError, SGLangServer, gc_paused, sglang_server,
                                          verify_inside_sglang, vision_language)
from megarl.rollout.transports import cuda_ipc
from megarl.utils.hf_config import language_fields



FLUSH_WAIT_S = 30  # the most a prefix-cache flush waits for the server to become idle


@dataclass
class _ServerState:
    load: int = 0  # rows in flight
    kv_released: bool = False
    weights_released: bool = False
    version: int = 0  # the engine's weight version this server holds (0: its checkpoint's)
    flush: bool = False  # weights changed since its last generate: drop the prefix cache


class SGLangRolloutEngine(RolloutEngine):
    def __init__(self, model_path: str, num_servers: int = 1, tp: int = 1, colocated: bool = True,
                 verify_dir: str | None = None, sampling_overrides: dict | None = None,
                 weight_format: str = "persistent", launch: Callable[[int], SGLangServer] | None = None,
                 gpus: list[str] | None = None, rows_per_request: int = 0, batch_rows: int = 0,
                 serializer: Callable[[object], str] | None = None, deterministic: bool = False,
                 release_kv: bool | None = None, hosts: list[tuple] | None = None, sender_node: str | None = None,
                 record_routing: bool = False, lora: tuple[int, list[str]] | None = None, **server_kwargs):
        """`gpus`: GPU ids (as CUDA_VISIBLE_DEVICES names them) to spread one server per `tp` of them over, in
        place of `num_servers` servers on this process's first num_servers * tp visible GPUs.
        `rows_per_request`: a generate call's rows for a server go in concurrent requests of at most this many
        rows (a prompt's n samples stay together); 0 = one request per server.
        `batch_rows`: the rows of a step's generate call (prompts x n), which sizes each server's decode CUDA
        graphs (sglang_server's decode_rows); 0 = SGLang's own sizes.
        `serializer`: how requests to megarl's loader inside SGLang carry tensors (default SGLang's CUDA IPC).
        `deterministic`: servers in SGLang's deterministic-inference mode, and a sampling seed per response
        (SGLang ignores seeds outside that mode), so the same call with the same params.seed samples the same.
        `release_kv`: a server with no rows in flight gives its KV cache back (to the trainer) until the next
        generate; default: when colocated (the asynchronous modes, generating beside training, keep it).
        `hosts`: servers on server hosts (server_host.py), (ServerHost actor, its number of servers, the GPUs they go
        on or None for the host's own) each, in place of `gpus` and `num_servers`.
        `sender_node`: colocated servers on hosts: the Ray node id of the training rank that sends the weights; the
        servers of that node take them by CUDA IPC, the others by NCCL broadcast. None: each server's own training
        ranks send (sharded delivery, every generation TP group to its server): CUDA IPC for all.
        `record_routing`: each Generation carries the experts its tokens were routed to (SGLang's
        --enable-return-routed-experts and a request's return_routed_experts; actor.router_replay=rollout).
        `lora`: (rank, projections): syncs load LoRA adapters (load_lora_adapter, rollout.lora_sync=adapter) that
        the servers serve beside their base weights, which then stay in memory between rollouts."""
        self.model_path, self.colocated, self.rows_per_request = model_path, colocated, rows_per_request
        self.release_kv = colocated if release_kv is None else release_kv
        self.deterministic = deterministic
        if gpus:
            if len(gpus) % tp:
                raise ValueError(f"{len(gpus)} GPUs ({','.join(gpus)}) cannot hold servers of tensor-parallel size {tp}")
            num_servers = len(gpus) // tp
        if hosts:
            num_servers = sum(count for _, count, _ in hosts)
        self.sampling_overrides = dict(sampling_overrides or {})  # e.g. ignore_eos for benchmarks
        # SGLang's memory saver only where memory is released between phases (colocated): it is off in
        # sglang.Engine's defaults, and a disaggregated server has no use for it
        server_kwargs = {"memory_saver": colocated, "deterministic": deterministic} | server_kwargs
        # (layers, topk) of each token's record, the request asks for it
        self.routing = routing_shape(model_path) if record_routing else None
        if record_routing:
            server_kwargs["routed_experts"] = True
        if lora is not None:
            server_kwargs["lora"] = lora
        self.adapters = lora is not None
        self.adapter: str | None = None  # the name the servers hold the current policy's adapter under
        if batch_rows:  # a server's share, rounded up to 32 rows: routing splits whole prompt groups unevenly
            share = -(-batch_rows // num_servers)
            server_kwargs.setdefault("decode_rows", -(-share // 32) * 32)
        launch = launch or (lambda i: sglang_server(model_path, tp=tp, gpu=i * tp, visible_devices=gpus,
                                                    **server_kwargs))
        self.servers = remote_servers(hosts, model_path, tp, server_kwargs) if hosts else \
            [launch(i) for i in range(num_servers)]
        with ThreadPoolExecutor(len(self.servers)) as pool:  # `launch` may hand over running servers
            list(pool.map(lambda s: s if s.alive() else s.start(), self.servers))
        self.state = [_ServerState() for _ in self.servers]
        self.sticky: dict[str, int] = {}
        self.lock = threading.RLock()  # routing state and the memory transitions that depend on it
        # how the sending training rank reaches each server: CUDA IPC on its own GPUs (colocated on its node)
        self.transports = ["cuda_ipc" if colocated and (sender_node is None or not s.remote or s.node == sender_node)
                           else "nccl" for s in self.servers]
        self.version = 0  # weight syncs started
        self.syncing = False
        self.weight_format = weight_format
        self._sender: cuda_ipc.CudaIpcSender | None = None
        self.serializer = serializer
        self.verify_dir = Path(verify_dir) if verify_dir else None
        self.received: dict[str, torch.Tensor] = {}  # CPU copies of this sync's tensors, for verify_weights
        self.restarts = 0
        self.gate = GenerationGate()  # pauses generation at weight updates (partial rollouts)
        # a vision-language model's image token id and spatial merge (sglang_images.py)
        self.vision: tuple[int, int] | None = vision_fields(model_path) if vision_language(model_path) else None

    # ---- routing ----------------------------------------------------------------------------------

    def _fresh(self) -> list[int]:
        """Servers holding the current policy (all of them until a server restarts after a sync)."""
        fresh = [i for i, s in enumerate(self.state) if s.version == self.version and self.servers[i].alive()]
        return fresh or list(range(len(self.servers)))

    def _assign(self, conversation: str | None, rows: int) -> int:
        """Least-loaded fresh server (sticky per conversation); counts the rows in flight."""
        with self.lock:
            index = self.sticky.get(conversation) if conversation is not None else None
            if index is None or index not in self._fresh():
                index = min(self._fresh(), key=lambda i: self.state[i].load)
                if conversation is not None:
                    self.sticky[conversation] = index
            self.state[index].load += rows
            return index

    def _done(self, index: int, rows: int) -> None:
        with self.lock:
            state = self.state[index]
            state.load -= rows
            if self.release_kv and state.load == 0 and not state.kv_released and self.servers[index].alive():
                # nothing in flight: give the KV cache's memory back to the trainer until the next rollout
                self.servers[index].post("/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
                state.kv_released = True

    def _prepare(self, index: int) -> None:
        with self.lock:
            state, server = self.state[index], self.servers[index]
            if state.weights_released:
                raise SGLangError(f"server {server.url}: its weights were released and not pushed again; "
                                  "sync before generating")
            if state.kv_released:
                server.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
                state.kv_released = False
                state.flush = False  # releasing the KV cache flushed the prefix cache: nothing stale since
            if state.flush:
                # SGLang flushes only an idle server: this waits for the requests an abort just ended to clear out
                server.post(f"/flush_cache?timeout={FLUSH_WAIT_S}")
                state.flush = False
            self.syncing = False

    # ---- generation -------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, images: list[ImageInputs | None] | None = None,
                 conversations: list[str] | None = None, max_new_tokens: list[int] | None = None,
                 on_group: Callable[[int, list[Generation]], None] | None = None,
                 on_tokens: Callable[[int, int, list[int]], None] | None = None) -> list[Generation]:
        """`images`: one entry per prompt (megarl.rollout.base.ImageInputs), None for text only.
        `on_group`: a prompt's group as its request returns; each prompt gets a request of its own then (SGLang
        batches concurrent requests as it batches one request's rows), so a group ends as soon as its rows do.
        `conversations`: an id per prompt, whose turns stay on one server (its prefix cache).
        `max_new_tokens`: a limit per prompt in place of params.max_new_tokens (multi-turn rollouts batch
        turns with different budgets; SGLang refuses a row whose prompt plus limit passes the context).
        `on_tokens(row, offset, token_ids)`: each row's tokens as the server streams them (row: prompt * n + sample;
        SGLang's `"stream": true` on /generate, StreamedRows), from a thread of the call's."""
        images = check_images(prompts, images, type(self).__name__, supported=True)
        if any(i is not None for i in images) and self.vision is None:
            self.vision = vision_fields(self.model_path)  # (image token id, spatial merge): raises for a text model
        limits = max_new_tokens or [params.max_new_tokens] * len(prompts)
        if min(limits, default=1) < 1 or params.n < 1:
            raise ValueError(f"max_new_tokens and n must be >= 1, got {min(limits)} and {params.n}")
        for name, per_prompt in (("conversation ids", conversations), ("token limits", max_new_tokens)):
            if per_prompt is not None and len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} {name} for {len(prompts)} prompts")
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang's off: -1
                    "stop_token_ids": list(params.stop_token_ids),
                    "ignore_eos": params.ignore_eos, **(placeholder_ban(self.vision[0]) if self.vision else {}),
                    **self.sampling_overrides}
        # deterministic mode: each response's seed from the call's seed, its prompt and its sample; without a seed,
        # a fresh one (SGLang would give every request its default seed: a prompt's n samples all alike)
        seed = (random.getrandbits(31) if params.seed is None else params.seed) if self.deterministic else None
        groups: dict[int, list[int]] = {}  # server -> prompt indices
        for i in range(len(prompts)):
            server = self._assign(conversations[i] if conversations else None, params.n)
            groups.setdefault(server, []).append(i)
        results: list[Generation | None] = [None] * (len(prompts) * params.n)

        def run(index: int, prompt_ids: list[int]) -> None:
            budget = (lambda i: limits[i]) if max_new_tokens is not None else (lambda i: sampling["max_new_tokens"])
            rows = [Row(list(prompts[i]), budget(i), None if seed is None else derive_seed(seed, i, j), images[i])
                    for i in prompt_ids for j in range(params.n)]

            def segment(inputs: list[list[int]], budgets: list[int], seeds: list, _: Segment,
                        images: list | None = None, ended=None, produced=None) -> list[Generation]:
                """One request: the rows as they stand (prompt + tokens so far), with what is left of each budget
                and each row's own seed (SGLang's seeded draws follow from the seed and the position), and each row's
                images (megarl's processed inputs: sglang_images.py). Its rows all
                end as it returns (`ended` is not called); `produced`: a streamed request's tokens as they come."""
                per_row = [sampling | {"max_new_tokens": b} | ({} if s is None else {"sampling_seed": s})
                           for b, s in zip(budgets, seeds)]
                image_data = request_image_data([None if im is None else image_item(ids, im, *self.vision)
                                                 for ids, im in zip(inputs, images or [None] * len(inputs))])
                return self._generate_on(index, inputs, per_row[0] if all(r == per_row[0] for r in per_row)
                                         else per_row, functools.partial(_to_generations, inputs, self.servers[index],
                                                           self.routing),
                                         image_data, produced)

            def call_row(k: int) -> int:  # row k of this request -> its row of the call
                return prompt_ids[k // params.n] * params.n + k % params.n

            try:
                generate_rows(rows, self.gate, segment, params.max_interruptions, None if collector is None else
                              lambda k, row: collector.add(call_row(k), row.generation(prompt_ids[k // params.n])),
                              None if on_tokens is None else lambda k, offset, ids: on_tokens(call_row(k), offset, ids))
            finally:
                self._done(index, len(rows))
            for k, row in enumerate(rows):
                results[call_row(k)] = row.generation(prompt_ids[k // params.n])

        collector = GroupCollector(params.n, on_group) if on_group is not None else None
        per = (1 if on_group is not None else max(1, self.rows_per_request // params.n) if self.rows_per_request
               else len(prompts))
        requests = [(s, ids[k:k + per]) for s, ids in groups.items() for k in range(0, len(ids), per)]
        with ThreadPoolExecutor(max(1, len(requests))) as pool:
            for future in [pool.submit(run, s, ids) for s, ids in requests]:
                future.result()
        return results

    def _generate_on(self, index: int, input_ids: list[list[int]], sampling: dict | list[dict],
                     convert: Callable[[list[dict]], list[Generation]], image_data: list | None = None,
                     produced: Callable[[int, int, list[int]], None] | None = None) -> list[Generation]:
        request = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
        if self.adapter is not None:
            request["lora_path"] = self.adapter  # the current policy's adapter, by the name it was loaded under
        if self.routing:
            request["return_routed_experts"] = True
        if image_data is not None:
            request["image_data"] = image_data
        try:  # preparing (a prefix-cache flush, the KV cache back) is the first request to find a server dead
            self._prepare(index)
            return self._post_generate(self.servers[index], request, convert, produced)
        except SGLangError:
            if not self.servers[index].died():
                raise
        target = self._recover(index)
        self._prepare(target)
        return self._post_generate(self.servers[target], request, convert, produced)

    @staticmethod
    def _post_generate(server: SGLangServer, request: dict, convert: Callable[[list[dict]], list[Generation]],
                       produced: Callable[[int, int, list[int]], None] | None) -> list[Generation]:
        """/generate, answered whole; with `produced`, streamed (its rows' tokens to `produced` as they come), the
        answer then assembled from the stream as the whole one reads."""
        if produced is None:
            return server.post("/generate", request, convert=convert)
        streamed = StreamedRows(len(request["input_ids"]), produced)
        server.post_stream("/generate", request | {"stream": True}, streamed.add)
        with gc_paused():
            return convert(streamed.outputs())

    def _recover(self, index: int) -> int:
        """Restart a dead server; return where to retry its request."""
        with self.lock:
            server = self.servers[index]
            if not server.alive():  # another thread may have restarted it already
                server.restart()
                self.restarts += 1
                self.state[index] = _ServerState(load=self.state[index].load)
            fresh = [i for i in self._fresh() if self.state[i].version == self.version]
            if self.version == 0 or index in fresh:
                return index
            if fresh:
                return min(fresh, key=lambda i: self.state[i].load)
            raise SGLangError(f"server {server.url} died and was restarted with its checkpoint weights; no server "
                              f"holds the current policy (version {self.version}): push the weights again")

    def abort(self) -> None:
        """Cancel every request in flight (e.g. over-sampled work); they finish with reason 'abort', for good."""
        self.gate.cancel()
        self._abort_all()

    def _abort_all(self) -> None:
        """SGLang answers an aborted request with the tokens and log-probs it generated so far."""
        for server in self.servers:
            server.post("/abort_request", {"abort_all": True})

    def pause_generation(self, partial: str = "resume") -> dict:
        """Requests in flight aborted (resume / restart) or run to their end (finish), new ones held here, so
        that the weight update that follows finds no request holding SGLang's model-update lock."""
        return self.gate.pause(partial, abort=self._abort_all)

    def resume_generation(self, version: int) -> None:
        self.gate.resume(version)

    # ---- weights ----------------------------------------------------------------------------------

    def begin_weight_update(self) -> list[Endpoint]:
        """Start a sync: weights memory back where it was released, a new weight version. Returns the
        endpoints a training rank sends buckets to itself, by their `transport`: CUDA IPC when colocated (the
        tensors are on a GPU the servers see), NCCL broadcast when not."""
        with self.lock:
            if not self.syncing:
                self.version += 1
                self.syncing = True
                self.received.clear()
            for server, state in zip(self.servers, self.state):
                if state.weights_released:
                    server.post("/resume_memory_occupation", {"tags": ["weights"]})
                    state.weights_released = False
                state.version, state.flush = self.version, True
        return [s.endpoint(transport) for s, transport in zip(self.servers, self.transports)]

    def end_weight_update(self, received: dict[str, torch.Tensor] | None = None) -> None:
        """A training rank finished posting a sync itself (after begin_weight_update). `received`: host copies
        of what it posted, kept for verify_weights on a verified sync (None otherwise). The next sync
        is a new weight version; each server drops its prefix cache before it next generates."""
        with self.lock:
            self.received = dict(received or {})
            self.syncing = False

    def load_lora_adapter(self, path: str) -> None:
        """An adapter-only sync: every server loads the PEFT adapter directory `path` under a new name (a new weight
        version), which the requests that follow ask for, and unloads the previous policy's; its prefix cache is
        flushed before it next generates."""
        with self.lock:
            self.version += 1
            name = f"policy_{self.version}"
            for server, state in zip(self.servers, self.state):
                server.post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
                if self.adapter is not None:
                    server.post("/unload_lora_adapter", {"lora_name": self.adapter})
                state.version, state.flush = self.version, True
            self.adapter = name

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        bucket = [(n, t if t.is_cuda else t.cuda()) for n, t in named_tensors]
        endpoints = self.begin_weight_update()
        if self._sender is None:
            self._sender = cuda_ipc.CudaIpcSender(endpoints, self.weight_format)
        self._sender.send(bucket)()
        if self.verify_dir is not None:
            self.received.update((n, t.detach().to("cpu", copy=True)) for n, t in bucket)

    def weight_checksums(self) -> dict[int, dict[int, dict[str, list]]]:
        """server -> TP rank -> the checksums of the parameters and persistent buffers it holds, taken on its GPUs now
        (megarl's loader inside SGLang: transports/sglang_loader.py inspect_weights), each server's on its own node. A
        verified sync asks after the rollout its weights generated and before training on it
        (RLTrainer.check_rollout_weights), while the weights are still held."""
        return {i: server.weight_checksums(self.serializer) for i, server in enumerate(self.servers)}

    def corrupt_weight(self, name: str, server: int = 0, rank: int = 0) -> None:
        """Test hook: flip a bit of parameter `name` (SGLang's name) in one TP worker's memory."""
        target = self.servers[server]
        target.inspect([{"flip_bit": name if r == rank else None} for r in range(target.tp)], self.serializer)

    def verify_weights(self) -> None:
        """SGLang checks itself: what it received against what its own loader reads from the exported file (written
        once for the servers of this node, by its host for a server on another: server_host.py)."""
        if self.verify_dir is None:
            raise SGLangError("verify_weights needs the engine built with verify_dir")
        here = [s.endpoint() for s in self.servers if not s.remote]
        if here:
            verify_inside_sglang(here, self.received, self.model_path, self.verify_dir)
        for server in self.servers:
            if server.remote:
                server.verify(self.received, self.model_path, str(self.verify_dir))

    def named_weights(self) -> dict[str, torch.Tensor]:
        """After verify_weights passed, SGLang holds exactly these tensors (the trainer's digest check
        then covers the hop from the trainer to this process)."""
        self.verify_weights()
        received, self.received = self.received, {}
        return received

    # ---- memory -----------------------------------------------------------------------------------

    def release_memory(self) -> None:
        """Weights and KV cache memory back to the trainer (only what is still held: a KV cache released after
        the last rollout is not released twice)."""
        with self.lock:
            for server, state in zip(self.servers, self.state):
                if self.adapters:  # adapter syncs send no base weights: they stay
                    if not state.kv_released:
                        server.post("/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
                    state.kv_released = True
                    continue
                if not state.weights_released:
                    tags = ["weights"] if state.kv_released else ["weights", "kv_cache", "cuda_graph"]
                    server.post("/release_memory_occupation", {"tags": tags})
                state.kv_released = state.weights_released = True

    def resume_memory(self) -> None:
        """Weights memory back (its values are not: push weights next); the KV cache comes back at generate."""
        with self.lock:
            for server, state in zip(self.servers, self.state):
                server.post("/resume_memory_occupation", {"tags": ["weights"]})
                state.weights_released = False

    def resume_kv_cache(self) -> None:
        """The KV cache back (and the prefix cache flushed after new weights) ahead of a rollout phase."""
        for index in range(len(self.servers)):
            self._prepare(index)

    def shutdown(self) -> None:
        if self._sender is not None:  # the servers let go of its buffers while they are up (CudaIpcSender.close)
            self._sender.close()
        for server in self.servers:
            server.shutdown()


_LOGPROB, _TOKEN_ID = itemgetter(0), itemgetter(1)


class StreamedRows:
    """A streamed /generate's rows, put together from its events: each event is one row's progress (its `index` in
    the request; a single row's has none), with meta_info's `output_token_logprobs` ([log-prob, id, text] per token)
    either every token so far (SGLang's default) or only the new ones (--incremental-streaming-output): the
    `completion_tokens` count, always the row's total, tells which. `produced(row, start, token_ids)` gets each row's
    new tokens; `outputs()` is the answer as a whole /generate gives it (the last meta_info, every token's pair)."""

    def __init__(self, rows: int, produced: Callable[[int, int, list[int]], None]):
        self.pairs: list[list] = [[] for _ in range(rows)]
        self.meta: list[dict | None] = [None] * rows
        self.produced = produced

    def add(self, event: dict) -> None:
        row, meta = event.get("index", 0), event["meta_info"]
        pairs, known = meta.get("output_token_logprobs") or [], self.pairs[row]
        total = meta.get("completion_tokens", len(pairs))
        new = pairs[len(known):] if len(pairs) == total else pairs
        known += new
        self.meta[row] = meta
        if new:
            self.produced(row, len(known) - len(new), list(map(_TOKEN_ID, new)))

    def outputs(self) -> list[dict]:
        missing = [row for row, meta in enumerate(self.meta) if meta is None or meta.get("finish_reason") is None]
        if missing:
            raise SGLangError(f"a streamed /generate ended before rows {missing} finished")
        return [{"meta_info": meta | {"output_token_logprobs": pairs}} for meta, pairs in zip(self.meta, self.pairs)]


def _to_generations(rows: list[list[int]], server: SGLangServer, routing: tuple[int, int] | None,
                    outputs) -> list[Generation]:
    if not isinstance(outputs, list) or len(outputs) != len(rows):
        raise SGLangError(f"/generate on {server.url}: expected {len(rows)} outputs, got "
                          f"{len(outputs) if isinstance(outputs, list) else type(outputs).__name__}")
    return [_to_generation(0, out, routing, len(row)) for row, out in zip(rows, outputs)]


def routing_shape(model_path: str) -> tuple[int, int]:
    """(decoder layers, experts per token) of a record of routed experts."""
    hf = language_fields(json.loads((Path(model_path) / "config.json").read_text()))
    return hf["num_hidden_layers"], hf["num_experts_per_tok"]


def routed_experts(meta: dict, routing: tuple[int, int], tokens: int) -> torch.Tensor:
    """SGLang's meta_info['routed_experts'] (base64 of int32 [prompt + response - 1, layers, topk]: every token it
    fed the model, every layer, the GLOBAL expert ids) -> [tokens, layers, topk] int16."""
    if "routed_experts" not in meta:
        raise SGLangError("the server returned no routed_experts: was it started with --enable-return-routed-experts?")
    flat = torch.frombuffer(bytearray(base64.b64decode(meta["routed_experts"])), dtype=torch.int32)
    record = flat.reshape(-1, *routing)
    if record.shape[0] != tokens:
        raise SGLangError(f"routed_experts for {record.shape[0]} tokens, the row fed {tokens}")
    return record.to(torch.int16)


def _to_generation(prompt_index: int, out: dict, routing: tuple[int, int] | None = None, fed: int = 0) -> Generation:
    meta = out["meta_info"]
    pairs = meta["output_token_logprobs"]  # [logprob, token id, text] per generated token
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    # itemgetter over the parsed JSON's ints and floats: a 512-row answer converts in a third of the time
    tokens = list(map(_TOKEN_ID, pairs))
    return Generation(prompt_index=prompt_index, token_ids=tokens, logprobs=list(map(_LOGPROB, pairs)),
                      finish_reason=reason, routed_experts=None if routing is None or not tokens else
                      routed_experts(meta, routing, fed + len(tokens) - 1))
