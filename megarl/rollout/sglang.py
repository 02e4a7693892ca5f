"""Rollouts from real SGLang servers (GPU): one `python -m sglang.launch_server` process per generation
TP group, owned by this engine.

- Start-up waits for /health with a deadline and fails with the tail of the server's log. Every HTTP
  call has a timeout: a hung server raises SGLangError naming the server, the call and the limit.
- generate(): token ids in, token ids and per-token log-probs out (SGLang's `output_token_logprobs`,
  under the raw logits as base.py requires at temperature 1), n samples per prompt, stop tokens.
  Prompts go to the least-loaded server (rows in flight), all n samples of a prompt to the same one
  (they share its prefix cache); a conversation id keeps a multi-turn conversation on one server.
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
  that memory back); the next generate resumes it first and flushes the prefix cache if weights
  changed. release_memory() also drops the weights (SGLang keeps no copy): they must be pushed again.
- Verification inside SGLang (`verify_weights`): the weights SGLang received are snapshotted by its
  own weights checker, reset to noise, reloaded by SGLang's own loader from a file of the exported
  tensors, and compared by the checker; any difference fails with SGLang's message.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Callable, Iterable

import requests
import torch

try:  # SGLang's own dependency: parses a rollout's answer (MBs of log-probs) several times faster than json
    from orjson import dumps as json_dumps, loads as json_loads
except ImportError:  # a CPU install without SGLang
    import json

    def json_dumps(value) -> bytes:
        return json.dumps(value).encode()
    json_loads = json.loads

from megarl.rollout.base import Generation, RolloutEngine, SamplingParams, derive_seed
from megarl.rollout.transports import cuda_ipc

SERVER_GUARD = str(Path(__file__).with_name("server_guard.py"))


class SGLangError(RuntimeError):
    """A server failed to start, died, hung, or answered a request with an error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a launcher (torchrun, torchelastic) sets for its own workers. A server started from such a worker must not
# inherit it: with TORCHELASTIC_USE_AGENT_STORE set, every rank of SGLang's own process group joins its store as a
# client and none serves it, so a TP>1 server waits at "Init torch distributed begin" until its start-up deadline.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# The launch arguments megarl owns (where the server listens and on which GPUs, its share of memory, how weights
# reach it); extra arguments may override the rest, such as the attention backend or CUDA-graph batch sizes.
MANAGED_ARGS = ("--model-path", "--host", "--port", "--tp-size", "--base-gpu-id", "--mem-fraction-static",
                "--skip-tokenizer-init", "--custom-weight-loader", "--enable-memory-saver",
                "--enable-deterministic-inference", "--dtype")
# The attention backends sglang 0.5.17 runs deterministic inference with (its server_args refuses the others).
DETERMINISTIC_ATTENTION_BACKENDS = ("triton", "fa3", "flashinfer")
# sglang 0.5.17 captures decode CUDA graphs up to 256 rows at TP < 4 on 80-160 GB GPUs (H100, H200); a larger
# batch decodes without them, 4x slower for a 0.5B model on an H200 (docs/benchmarks.md, session 7). megarl
# captures up to a server's share of the step's batch instead, to at most 1024 rows: past that, a step's GPU work
# hides most of the launch overhead graphs save, while capture time and memory keep growing (a judgment).
SGLANG_DECODE_GRAPH_ROWS, MAX_DECODE_GRAPH_ROWS = 256, 1024
TRANSPORTS = ("cuda_ipc", "nccl")  # how a training rank delivers weights to a server: transports/<name>.py

_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextmanager
def gc_paused():
    """No garbage collection inside: parsing a rollout's answer allocates ~10^5 small lists (a [log-prob, id, text]
    per token), enough to set off full collections of the driver's whole heap, inside rollout time: 0.4-0.55 s
    beside a heap of 3.5M objects (measured on the CPU). The lists die with the conversion, so nothing is deferred
    to the collector. Re-entrant across threads: collection resumes when the last one leaves."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


class Endpoint:
    """HTTP client of one SGLang server (picklable: a training rank can post weights itself). `transport`: how
    weights reach it (TRANSPORTS); `instance`: which process serves `url` (a restarted server is another one:
    its weight transfer state, such as a weight group, starts over)."""

    def __init__(self, url: str, tp: int = 1, request_timeout: float = 600.0, transport: str = "cuda_ipc",
                 instance: int | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
        self.url, self.tp, self.request_timeout = url, tp, request_timeout
        self.transport, self.instance = transport, instance

    def diagnose(self) -> str:
        """Extra context for an error message (the process's state and log, where known)."""
        return ""

    def post(self, path: str, payload: dict | None = None, timeout: float | None = None,
             convert: Callable | None = None):
        """The parsed answer, or what `convert` makes of it while the garbage collector is paused."""
        timeout = timeout or self.request_timeout
        try:
            response = requests.post(self.url + path, data=json_dumps(payload or {}), timeout=timeout,
                                     headers={"Content-Type": "application/json"})
        except requests.Timeout as error:
            raise SGLangError(f"{path} on {self.url}: no answer within {timeout:.0f} s (server hung?)"
                              f"{self.diagnose()}") from error
        except requests.RequestException as error:
            raise SGLangError(f"{path} on {self.url} failed: {error}{self.diagnose()}") from error
        if response.status_code != 200:
            raise SGLangError(f"{path} on {self.url}: HTTP {response.status_code}: {response.text[:2000]}")
        if not response.content:  # /abort_request answers with an empty 200
            return None
        with gc_paused():
            try:
                body = json_loads(response.content)
            except ValueError:  # some endpoints (/flush_cache) answer in plain text
                return response.text
            if isinstance(body, dict) and body.get("success") is False:
                raise SGLangError(f"{path} on {self.url}: {body.get('message')}")
            return convert(body) if convert else body


class SGLangServer(Endpoint):
    """One server process, started by `command` (listening on `port`), in its own session."""

    def __init__(self, command: list[str], port: int, tp: int = 1, log_path: str | None = None,
                 startup_timeout: float = 900.0, request_timeout: float = 600.0, health_timeout: float = 5.0,
                 env: dict[str, str] | None = None):
        super().__init__(f"http://127.0.0.1:{port}", tp, request_timeout)
        self.command, self.port = command, port
        self.env = env  # extra environment of the server process (its visible GPUs)
        self.startup_timeout, self.health_timeout = startup_timeout, health_timeout
        self.log_path = Path(log_path or Path(tempfile.gettempdir()) / f"sglang_{port}.log")
        self.process: subprocess.Popen | None = None

    def endpoint(self, transport: str = "cuda_ipc") -> Endpoint:
        return Endpoint(self.url, self.tp, self.request_timeout, transport, self.process.pid if self.process else None)

    def start(self) -> "SGLangServer":
        with open(self.log_path, "ab") as log:
            # Its own session, so shutdown() can end the server's whole process tree and nothing else; under a
            # guard (server_guard.py) that ends the server when this process dies without calling shutdown().
            self.process = subprocess.Popen([sys.executable, SERVER_GUARD, str(os.getpid()), *self.command],
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=self.server_env())
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SGLangError(f"server {self.url} exited with code {self.process.returncode} during start-up:\n"
                                  f"{self.log_tail()}")
            if self.healthy():
                # start-up objects (torch, the model's modules) out of the collector's reach in every process
                # of the server: a full collection then skips them, ~10^6 objects, while answers are built
                self.post("/freeze_gc")
                return self
            time.sleep(0.5)
        self.shutdown()
        raise SGLangError(f"server {self.url} not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def server_env(self) -> dict[str, str]:
        """This process's environment without its launcher's variables, plus the server's own (`env`)."""
        inherited = {k: v for k, v in os.environ.items()
                     if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
        return inherited | (self.env or {})

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=self.health_timeout).status_code == 200
        except requests.RequestException:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def died(self, grace: float = 10.0) -> bool:
        """After a failed call: has the process ended? A dying process may close its connections a
        moment before it exits, so an unhealthy one gets `grace` seconds to finish dying."""
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            if self.healthy():
                return False
            time.sleep(0.1)
        return not self.alive()

    def restart(self) -> "SGLangServer":
        self.shutdown()
        return self.start()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def diagnose(self) -> str:
        return "" if self.alive() else f" (server died)\n{self.log_tail()}"

    def shutdown(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def managed_args(extra_args: Iterable) -> list[str]:
    """Those of `extra_args` (as "--flag" or "--flag=value") that megarl sets itself."""
    return sorted({str(a).split("=")[0] for a in extra_args} & set(MANAGED_ARGS))


def attention_backend(extra_args: Iterable) -> str:
    """The attention backend a server launched with megarl's arguments and then `extra_args` uses."""
    args, backend = [str(a) for a in extra_args], "triton"  # megarl's own choice, unless extra_args override it
    for k, arg in enumerate(args):
        if arg.startswith("--attention-backend="):
            backend = arg.split("=", 1)[1]
        elif arg == "--attention-backend" and k + 1 < len(args):
            backend = args[k + 1]
    return backend


def decode_graph_rows(rows: int) -> int | None:
    """The largest decode batch to capture in a CUDA graph for a server that decodes `rows` rows at once;
    None while SGLang's own limit covers them."""
    return min(rows, MAX_DECODE_GRAPH_ROWS) if rows > SGLANG_DECODE_GRAPH_ROWS else None


def sglang_server(model_path: str, tp: int = 1, gpu: int = 0, mem_fraction: float = 0.5, memory_saver: bool = True,
                  load_format: str | None = None, cuda_graph: bool = True, decode_rows: int = 0,
                  extra_args: tuple[str, ...] = (), log_dir: str | None = None, visible_devices: list[str] | None = None,
                  env: dict | None = None, deterministic: bool = False, dtype: str = "bfloat16",
                  **kwargs) -> SGLangServer:
    """A real SGLang server on GPUs [gpu, gpu + tp) (not started). It accepts every cuda_ipc format.
    `decode_rows`: the rows it will decode at once (its share of a step's batch; decode_graph_rows).
    `visible_devices`: the server's CUDA_VISIBLE_DEVICES, which `gpu` indexes (a Ray actor sees only the
    GPUs Ray gave it: a server launched from the rollout actor must be told the training ranks' GPUs).
    `extra_args` come last, so they override megarl's defaults; none may be one of MANAGED_ARGS.
    `deterministic`: SGLang's deterministic inference (batch-invariant kernels; per-request sampling seeds count).
    `dtype`: what the server holds its weights in: the policy's own (the trainer sends that). SGLang's default
    follows the checkpoint's config and takes float16 for a float32 one, so a bf16 policy was silently converted
    to fp16 on load (out of range above 65504); checksum verification found it."""
    managed = managed_args(extra_args)
    if managed:
        raise ValueError(f"extra SGLang arguments {', '.join(managed)}: megarl sets these itself")
    if deterministic and attention_backend(extra_args) not in DETERMINISTIC_ATTENTION_BACKENDS:
        raise ValueError(f"deterministic inference needs attention backend {' / '.join(DETERMINISTIC_ATTENTION_BACKENDS)}"
                         f", the extra arguments ask for {attention_backend(extra_args)}")
    port, graph_rows = free_port(), decode_graph_rows(decode_rows)
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
               "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(tp),
               "--base-gpu-id", str(gpu), "--mem-fraction-static", str(mem_fraction), "--dtype", dtype,
               "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
               "--custom-weight-loader", cuda_ipc.PERSISTENT_LOADER,
               *(["--enable-memory-saver"] if memory_saver else []),
               *(["--enable-deterministic-inference"] if deterministic else []),
               *(["--load-format", load_format] if load_format else []),
               *([] if cuda_graph else ["--disable-cuda-graph"]),
               *(["--cuda-graph-max-bs-decode", str(graph_rows)] if cuda_graph and graph_rows else []),
               *map(str, extra_args)]
    log = Path(log_dir or tempfile.gettempdir()) / f"sglang_{port}.log"
    env = dict(env or {}) | ({"CUDA_VISIBLE_DEVICES": ",".join(visible_devices)} if visible_devices else {})
    return SGLangServer(command, port, tp, str(log), env=env, **kwargs)


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
                 serializer: Callable[[object], str] | None = None, deterministic: bool = False, **server_kwargs):
        """`gpus`: GPU ids (as CUDA_VISIBLE_DEVICES names them) to spread one server per `tp` of them over, in
        place of `num_servers` servers on this process's first num_servers * tp visible GPUs.
        `rows_per_request`: a generate call's rows for a server go in concurrent requests of at most this many
        rows (a prompt's n samples stay together); 0 = one request per server.
        `batch_rows`: the rows of a step's generate call (prompts x n), which sizes each server's decode CUDA
        graphs (sglang_server's decode_rows); 0 = SGLang's own sizes.
        `serializer`: how requests to megarl's loader inside SGLang carry tensors (default SGLang's CUDA IPC).
        `deterministic`: servers in SGLang's deterministic-inference mode, and a sampling seed per response
        (SGLang ignores seeds outside that mode), so the same call with the same params.seed samples the same."""
        self.model_path, self.colocated, self.rows_per_request = model_path, colocated, rows_per_request
        self.deterministic = deterministic
        if gpus:
            if len(gpus) % tp:
                raise ValueError(f"{len(gpus)} GPUs ({','.join(gpus)}) cannot hold servers of tensor-parallel size {tp}")
            num_servers = len(gpus) // tp
        self.sampling_overrides = dict(sampling_overrides or {})  # e.g. ignore_eos for benchmarks
        # SGLang's memory saver only where memory is released between phases (colocated): it is off in
        # sglang.Engine's defaults, and a disaggregated server has no use for it
        server_kwargs = {"memory_saver": colocated, "deterministic": deterministic} | server_kwargs
        if batch_rows:  # a server's share, rounded up to 32 rows: routing splits whole prompt groups unevenly
            share = -(-batch_rows // num_servers)
            server_kwargs.setdefault("decode_rows", -(-share // 32) * 32)
        launch = launch or (lambda i: sglang_server(model_path, tp=tp, gpu=i * tp, visible_devices=gpus,
                                                    **server_kwargs))
        self.servers = [launch(i) for i in range(num_servers)]
        with ThreadPoolExecutor(len(self.servers)) as pool:  # `launch` may hand over running servers
            list(pool.map(lambda s: s if s.alive() else s.start(), self.servers))
        self.state = [_ServerState() for _ in self.servers]
        self.sticky: dict[str, int] = {}
        self.lock = threading.RLock()  # routing state and the memory transitions that depend on it
        self.version = 0  # weight syncs started
        self.syncing = False
        self.weight_format = weight_format
        self._sender: cuda_ipc.CudaIpcSender | None = None
        self.serializer = serializer
        self.checksum_dir: Path | None = None  # where SGLang's TP workers write their checksums
        self.verify_dir = Path(verify_dir) if verify_dir else None
        self.received: dict[str, torch.Tensor] = {}  # CPU copies of this sync's tensors, for verify_weights
        self.restarts = 0

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
            if self.colocated and state.load == 0 and not state.kv_released and self.servers[index].alive():
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
                server.post("/flush_cache")
                state.flush = False
            self.syncing = False

    # ---- generation -------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, conversations: list[str] | None = None,
                 max_new_tokens: list[int] | None = None) -> list[Generation]:
        """`conversations`: an id per prompt, whose turns stay on one server (its prefix cache).
        `max_new_tokens`: a limit per prompt in place of params.max_new_tokens (multi-turn rollouts batch
        turns with different budgets; SGLang refuses a row whose prompt plus limit passes the context)."""
        limits = max_new_tokens or [params.max_new_tokens] * len(prompts)
        if min(limits, default=1) < 1 or params.n < 1:
            raise ValueError(f"max_new_tokens and n must be >= 1, got {min(limits)} and {params.n}")
        for name, per_prompt in (("conversation ids", conversations), ("token limits", max_new_tokens)):
            if per_prompt is not None and len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} {name} for {len(prompts)} prompts")
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "stop_token_ids": list(params.stop_token_ids),
                    "ignore_eos": params.ignore_eos, **self.sampling_overrides}
        # deterministic mode: each response's seed from the call's seed, its prompt and its sample; without a seed,
        # a fresh one (SGLang would give every request its default seed: a prompt's n samples all alike)
        seed = (random.getrandbits(31) if params.seed is None else params.seed) if self.deterministic else None
        groups: dict[int, list[int]] = {}  # server -> prompt indices
        for i in range(len(prompts)):
            server = self._assign(conversations[i] if conversations else None, params.n)
            groups.setdefault(server, []).append(i)
        results: list[Generation | None] = [None] * (len(prompts) * params.n)

        def run(index: int, prompt_ids: list[int]) -> None:
            rows = [prompts[i] for i in prompt_ids for _ in range(params.n)]
            row_sampling = sampling if max_new_tokens is None and seed is None else \
                [sampling | ({} if max_new_tokens is None else {"max_new_tokens": limits[i]})
                 | ({} if seed is None else {"sampling_seed": derive_seed(seed, i, j)})
                 for i in prompt_ids for j in range(params.n)]

            def to_generations(outputs) -> list[Generation]:
                if not isinstance(outputs, list) or len(outputs) != len(rows):
                    raise SGLangError(f"/generate on {self.servers[index].url}: expected {len(rows)} outputs, got "
                                      f"{len(outputs) if isinstance(outputs, list) else type(outputs).__name__}")
                return [_to_generation(prompt_ids[k // params.n], out) for k, out in enumerate(outputs)]

            try:
                generations = self._generate_on(index, rows, row_sampling, to_generations)
            finally:
                self._done(index, len(rows))
            for k, generation in enumerate(generations):
                results[generation.prompt_index * params.n + k % params.n] = generation

        per = max(1, self.rows_per_request // params.n) if self.rows_per_request else len(prompts)
        requests = [(s, ids[k:k + per]) for s, ids in groups.items() for k in range(0, len(ids), per)]
        with ThreadPoolExecutor(max(1, len(requests))) as pool:
            for future in [pool.submit(run, s, ids) for s, ids in requests]:
                future.result()
        return results

    def _generate_on(self, index: int, input_ids: list[list[int]], sampling: dict | list[dict],
                     convert: Callable[[list[dict]], list[Generation]]) -> list[Generation]:
        request = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
        self._prepare(index)
        try:
            return self.servers[index].post("/generate", request, convert=convert)
        except SGLangError:
            if not self.servers[index].died():
                raise
        target = self._recover(index)
        self._prepare(target)
        return self.servers[target].post("/generate", request, convert=convert)

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
        """Abort every request in flight (e.g. over-sampled work); they finish with reason 'abort'."""
        for server in self.servers:
            server.post("/abort_request", {"abort_all": True})

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
        return [s.endpoint("cuda_ipc" if self.colocated else "nccl") for s in self.servers]

    def end_weight_update(self, received: dict[str, torch.Tensor] | None = None) -> None:
        """A training rank finished posting a sync itself (after begin_weight_update). `received`: host copies
        of what it posted, kept for verify_weights on a verified sync (None otherwise). The next sync
        is a new weight version; each server drops its prefix cache before it next generates."""
        with self.lock:
            self.received = dict(received or {})
            self.syncing = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        bucket = [(n, t if t.is_cuda else t.cuda()) for n, t in named_tensors]
        endpoints = self.begin_weight_update()
        if self._sender is None:
            self._sender = cuda_ipc.CudaIpcSender(endpoints, self.weight_format)
        self._sender.send(bucket)()
        if self.verify_dir is not None:
            self.received.update((n, t.detach().to("cpu", copy=True)) for n, t in bucket)

    def weight_checksums(self) -> dict[int, dict[int, dict[str, list]]]:
        """Every server's TP workers checksum the parameters they hold, on their GPUs (megarl's loader inside
        SGLang: cuda_ipc.inspect_weights), and write them to files read here."""
        if self.checksum_dir is None:
            self.checksum_dir = Path(tempfile.mkdtemp(prefix="megarl-checksums-"))
        files = {(i, r): self.checksum_dir / f"server{i}_rank{r}.json"
                 for i, s in enumerate(self.servers) for r in range(s.tp)}
        for path in files.values():
            path.unlink(missing_ok=True)
        self._inspect(lambda i, r: {"checksums": str(files[i, r])})
        held: dict[int, dict[int, dict[str, list]]] = {}
        for (i, r), path in files.items():
            held.setdefault(i, {})[r] = json.loads(path.read_text())
        return held

    def corrupt_weight(self, name: str, server: int = 0, rank: int = 0) -> None:
        """Test hook: flip a bit of parameter `name` (SGLang's name) in one TP worker's memory."""
        self._inspect(lambda i, r: {"flip_bit": name if r == rank else None}, servers=[server])

    def _inspect(self, header: Callable[[int, int], dict], servers: list[int] | None = None) -> None:
        """Post one request per server to megarl's loader inside SGLang with header(server, rank) for each TP
        rank; the payload's tensor is a placeholder (SGLang moves it to the rank's device first)."""
        serialize = self.serializer or cuda_ipc.sglang_serializer()
        placeholder = torch.zeros(1, dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
        for i in servers if servers is not None else range(len(self.servers)):
            payloads = [serialize([(json.dumps(header(i, r)), placeholder)]) for r in range(self.servers[i].tp)]
            self.servers[i].post("/update_weights_from_tensor", cuda_ipc.persistent_request(payloads))

    def verify_weights(self) -> None:
        """SGLang checks itself: what it received against what its own loader reads from the exported file."""
        if self.verify_dir is None:
            raise SGLangError("verify_weights needs the engine built with verify_dir")
        verify_inside_sglang([s.endpoint() for s in self.servers], self.received, self.model_path, self.verify_dir)

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


def verify_inside_sglang(endpoints: list[Endpoint], received: dict[str, torch.Tensor], model_path: str,
                         directory: Path) -> None:
    """Snapshot what the servers hold, reset, reload `received` from a file with SGLang's own loader, compare."""
    from safetensors.torch import save_file

    directory = Path(directory) / "exported"
    directory.mkdir(parents=True, exist_ok=True)
    save_file(received, str(directory / "model.safetensors"))
    for name in os.listdir(model_path):  # config and tokenizer files: SGLang's loader reads them
        if not name.endswith(".safetensors") and not (directory / name).exists():
            (directory / name).symlink_to(Path(model_path, name).resolve())
    for endpoint in endpoints:
        endpoint.post("/weights_checker", {"action": "snapshot"})
        endpoint.post("/weights_checker", {"action": "reset_tensors"})
        endpoint.post("/update_weights_from_disk", {"model_path": str(directory), "load_format": "safetensors",
                                                    "flush_cache": True})
        endpoint.post("/weights_checker", {"action": "compare"})


_LOGPROB, _TOKEN_ID = itemgetter(0), itemgetter(1)


def _to_generation(prompt_index: int, out: dict) -> Generation:
    meta = out["meta_info"]
    pairs = meta["output_token_logprobs"]  # [logprob, token id, text] per generated token
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    # itemgetter over the parsed JSON's ints and floats: a 512-row answer converts in a third of the time
    return Generation(prompt_index=prompt_index, token_ids=list(map(_TOKEN_ID, pairs)),
                      logprobs=list(map(_LOGPROB, pairs)), finish_reason=reason)
