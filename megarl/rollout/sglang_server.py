"""SGLang's server side (GPU): the `python -m sglang.launch_server` command megarl launches for one generation TP
group (the arguments megarl manages and those a recipe may add), the server process (SGLangServer) and the HTTP
client of a server (Endpoint). The rollout engine that owns the servers is sglang.py.

- Start-up waits for /health with a deadline and fails with the tail of the server's log. Every HTTP
  call has a timeout: a hung server raises SGLangError naming the server, the call and the limit.
- A server runs in a session of its own under server_guard.py, without its launcher's process-group
  variables (LAUNCHER_ENV), so shutdown() ends its whole tree and its owner's death ends it too.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

import requests

try:  # SGLang's own dependency: parses a rollout's answer (MBs of log-probs) several times faster than json
    from orjson import dumps as json_dumps, loads as json_loads
except ImportError:  # a CPU install without SGLang
    def json_dumps(value) -> bytes:
        return json.dumps(value).encode()
    json_loads = json.loads

from megarl.config.sglang_args import DETERMINISTIC_ATTENTION_BACKENDS, attention_backend, managed_args
from megarl.rollout.sglang_images import PROCESSOR_PACKAGE
from megarl.rollout.transports import cuda_ipc, sglang_loader
from megarl.utils.hf_config import TEXT_ONLY_TOWERS

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
# sglang 0.5.17 captures decode CUDA graphs up to 256 rows at TP < 4 on 80-160 GB GPUs (H100, H200); a larger
# batch decodes without them, 4x slower for a 0.5B model on an H200 (docs/benchmarks.md, session 7). megarl
# captures up to a server's share of the step's batch instead, to at most 1024 rows: past that, a step's GPU work
# hides most of the launch overhead graphs save, while capture time and memory keep growing (a judgment).
SGLANG_DECODE_GRAPH_ROWS, MAX_DECODE_GRAPH_ROWS = 256, 1024
# A vision-language model's vision tower: SGLang's default attention on Hopper is FA3 (sgl_kernel's flash_ops), which
# the bundle's sgl_kernel does not have; its Triton kernel (or sdpa) runs anywhere SGLang does.
MM_ATTENTION_BACKEND = "triton_attn"
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

    remote = False  # a server on a server host (server_host.RemoteServer), whose node may be another

    def __init__(self, url: str, tp: int = 1, request_timeout: float = 600.0, transport: str = "cuda_ipc",
                 instance: int | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
        self.url, self.tp, self.request_timeout = url, tp, request_timeout
        self.transport, self.instance = transport, instance

    def diagnose(self, grace: float = 0.0) -> str:
        """Extra context for an error message (the process's state and log, where known)."""
        return ""

    def post(self, path: str, payload: dict | None = None, timeout: float | None = None,
             convert: Callable | None = None):
        """The parsed answer, or what `convert` makes of it while the garbage collector is paused."""
        response = self._request(path, payload, timeout)
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

    def post_stream(self, path: str, payload: dict, on_event: Callable[[dict], None],
                    timeout: float | None = None) -> None:
        """A streaming request (`"stream": true`): `on_event` gets each server-sent event's JSON as it arrives, until
        `data: [DONE]`; an error event raises. `timeout` bounds each wait for the next bytes, not the whole answer."""
        response = self._request(path, payload, timeout, stream=True)
        with response:
            try:
                for line in response.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    data = line[len(b"data:"):].strip()
                    if data == b"[DONE]":
                        return
                    event = json_loads(data)
                    if isinstance(event, dict) and "error" in event:
                        raise SGLangError(f"{path} on {self.url}: {event['error']}")
                    on_event(event)
            except requests.RequestException as error:
                raise SGLangError(f"{path} on {self.url}: the stream broke off: {error}"
                                  f"{self.diagnose(grace=5.0)}") from error
        raise SGLangError(f"{path} on {self.url}: the stream ended without data: [DONE]")

    def _request(self, path: str, payload: dict | None, timeout: float | None,
                 stream: bool = False) -> requests.Response:
        timeout = timeout or self.request_timeout
        try:
            response = requests.post(self.url + path, data=json_dumps(payload or {}), timeout=timeout,
                                     headers={"Content-Type": "application/json"}, stream=stream)
        except requests.Timeout as error:
            raise SGLangError(f"{path} on {self.url}: no answer within {timeout:.0f} s (server hung?)"
                              f"{self.diagnose()}") from error
        except requests.RequestException as error:  # a dropped connection: the process may be dying (out of memory)
            raise SGLangError(f"{path} on {self.url} failed: {error}{self.diagnose(grace=5.0)}") from error
        if response.status_code != 200:
            raise SGLangError(f"{path} on {self.url}: HTTP {response.status_code}: {response.text[:2000]}")
        return response


class SGLangServer(Endpoint):
    """One server process, started by `command` (listening on `port`), in its own session."""

    def __init__(self, command: list[str], port: int, tp: int = 1, log_path: str | None = None,
                 startup_timeout: float = 900.0, request_timeout: float = 600.0, health_timeout: float = 5.0,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1", progress_s: float = 120.0):
        super().__init__(f"http://{host}:{port}", tp, request_timeout)
        self.command, self.port = command, port
        self.env = env  # extra environment of the server process (its visible GPUs)
        self.startup_timeout, self.health_timeout = startup_timeout, health_timeout
        self.progress_s = progress_s  # a start-up that long says so, and again each as long (start)
        self.log_path = Path(log_path or Path(tempfile.gettempdir()) / f"sglang_{port}.log")
        self.process: subprocess.Popen | None = None
        self.checksum_dir: Path | None = None  # where its TP workers write their checksums (weight_checksums)

    def endpoint(self, transport: str = "cuda_ipc") -> Endpoint:
        return Endpoint(self.url, self.tp, self.request_timeout, transport, self.process.pid if self.process else None)

    def start(self) -> "SGLangServer":
        with open(self.log_path, "ab") as log:
            # Its own session, so shutdown() can end the server's whole process tree and nothing else; under a
            # guard (server_guard.py) that ends the server when this process dies without calling shutdown().
            self.process = subprocess.Popen([sys.executable, SERVER_GUARD, str(os.getpid()), *self.command],
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=self.server_env())
        started = time.monotonic()
        deadline, report = started + self.startup_timeout, started + self.progress_s
        while time.monotonic() < deadline:
            if time.monotonic() >= report:  # a slow start (a first JIT, a stall) says where to look
                report += self.progress_s
                print(f"megarl: SGLang server {self.url} not up after {time.monotonic() - started:.0f} s of "
                      f"{self.startup_timeout:.0f}; its log {self.log_path} ends: {self.log_tail(1)[-200:]}",
                      flush=True)
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

    def diagnose(self, grace: float = 0.0) -> str:
        """Whether the process ended, with its log's last lines; a process that dropped a connection gets `grace`
        seconds to exit (it closes its sockets a moment before)."""
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive():
            return ""
        return f" (server died, exit code {self.process.returncode if self.process else None})\n{self.log_tail()}"

    def inspect(self, headers: list[dict], serialize: Callable | None = None) -> None:
        """One request to megarl's loader inside SGLang with headers[r] for TP rank r (cuda_ipc.inspect_request); its
        tensor is a placeholder, which SGLang moves to each rank's device first. Posted from this process, on the
        server's node: the placeholder travels by CUDA IPC on a GPU machine."""
        import torch

        serialize = serialize or cuda_ipc.sglang_serializer()
        placeholder = torch.zeros(1, dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
        self.post("/update_weights_from_tensor", cuda_ipc.inspect_request(serialize, placeholder, headers))

    def weight_checksums(self, serialize: Callable | None = None) -> dict[int, dict[str, list]]:
        """TP rank -> the checksums of the parameters and persistent buffers it holds, taken on its GPU now
        (sglang_loader.inspect_weights), written to files on this node and read here."""
        if self.checksum_dir is None:
            self.checksum_dir = Path(tempfile.mkdtemp(prefix="megarl-checksums-"))
        files = [Path(cuda_ipc.checksum_file(str(self.checksum_dir / "server"), r)) for r in range(self.tp)]
        for path in files:
            path.unlink(missing_ok=True)
        self.inspect([{"checksums": str(path)} for path in files], serialize)
        held = {}
        for rank, path in enumerate(files):
            held[rank] = json_loads(path.read_bytes())  # orjson where SGLang is
            path.unlink()
        return held

    def verify(self, received: dict, model_path: str, directory: str) -> None:
        """verify_inside_sglang for this server alone, its file written on this node."""
        verify_inside_sglang([self.endpoint()], received, model_path, Path(directory))

    def shutdown(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def verify_inside_sglang(endpoints: list[Endpoint], received: dict, model_path: str, directory: Path) -> None:
    """Snapshot what the servers hold, reset, reload `received` (name -> CPU tensor) from a file with SGLang's own
    loader, compare. The file goes to `directory`, which every server must be able to read."""
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


def allreduce_fusion_args(tp: int, extra_args: Iterable) -> list[str]:
    """SGLang turns FlashInfer's all-reduce fusion on by itself for DeepSeek-V3 at TP > 1 on H100/H200; on the
    bundle's flashinfer (JIT, no prebuilt comm kernels) the server then printed nothing for minutes after its
    workspace set-up and never came up (2 x H200, TP=2). Off unless `extra_args` choose a fusion backend."""
    chosen = any(str(a).startswith("--flashinfer-allreduce-fusion-backend") for a in extra_args)
    return ["--enforce-disable-flashinfer-allreduce-fusion"] if tp > 1 and not chosen else []


def decode_graph_rows(rows: int) -> int | None:
    """The largest decode batch to capture in a CUDA graph for a server that decodes `rows` rows at once;
    None while SGLang's own limit covers them."""
    return min(rows, MAX_DECODE_GRAPH_ROWS) if rows > SGLANG_DECODE_GRAPH_ROWS else None


def vision_language(model_path: str) -> bool:
    """Whether the model directory holds a vision-language model megarl sends images to (a config.json with a
    vision_config, other than a text-only policy's: TEXT_ONLY_TOWERS)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in config and config.get("model_type") not in TEXT_ONLY_TOWERS


def vision_args(model_path: str, tp: int) -> tuple[list[str], dict[str, str]]:
    """Launch arguments and environment of a server of a vision-language model (none for a text model): the vision
    tower's attention backend (MM_ATTENTION_BACKEND; extra arguments coming later may choose another), the tower
    replicated on every TP rank (--mm-enable-dp-encoder: each rank encodes a share of the images; megarl's weight
    layout, rollout/weight_layout.py, counts on it), and megarl's processor inside the server, which decodes the
    processed images megarl sends (sglang_images.py).
    SGLang's vision-embedding cache off (SGLANG_VLM_CACHE_SIZE_MB=0): it keeps the tower's output per image hash
    across weight updates (neither a weight update nor /flush_cache clears it), so an image seen before a sync
    would be read with the old tower's features after it, and the rollout's log-probs would be off the policy
    (SGLang turns it off for its own RL mode, --rl-on-policy-target, likewise). The launch's `env` may set it."""
    if not vision_language(model_path):
        return [], {}
    args = ["--mm-attention-backend", MM_ATTENTION_BACKEND] + (["--mm-enable-dp-encoder"] if tp > 1 else [])
    return args, {"SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE": PROCESSOR_PACKAGE, "SGLANG_VLM_CACHE_SIZE_MB": "0"}


def sglang_server(model_path: str, tp: int = 1, gpu: int = 0, mem_fraction: float = 0.5, memory_saver: bool = True,
                  load_format: str | None = None, cuda_graph: bool = True, decode_rows: int = 0,
                  extra_args: tuple[str, ...] = (), log_dir: str | None = None, visible_devices: list[str] | None = None,
                  env: dict | None = None, deterministic: bool = False, dtype: str = "bfloat16",
                  fp32_lm_head: bool = False, host: str = "127.0.0.1", routed_experts: bool = False,
                  lora: tuple[int, list[str]] | None = None, **kwargs) -> SGLangServer:
    """A real SGLang server on GPUs [gpu, gpu + tp) (not started). It accepts every cuda_ipc format.
    `decode_rows`: the rows it will decode at once (its share of a step's batch; decode_graph_rows).
    `visible_devices`: the server's CUDA_VISIBLE_DEVICES, which `gpu` indexes (a Ray actor sees only the
    GPUs Ray gave it: a server launched from the rollout actor must be told the training ranks' GPUs).
    `extra_args` come last, so they override megarl's defaults; none may be one of MANAGED_ARGS.
    `deterministic`: SGLang's deterministic inference (batch-invariant kernels; per-request sampling seeds count).
    `dtype`: what the server holds its weights in: the policy's own (the trainer sends that). SGLang's default
    follows the checkpoint's config and takes float16 for a float32 one, so a bf16 policy was silently converted
    to fp16 on load (out of range above 65504); checksum verification found it.
    `fp32_lm_head`: the output layer and the logits in float32 (--enable-fp32-lm-head; actor.fp32_lm_head).
    `routed_experts`: requests may ask for the experts each token was routed to (--enable-return-routed-experts;
    actor.router_replay=rollout).
    `lora`: (rank, projections): the server serves LoRA adapters of that rank on those projections, loaded while
    it runs (/load_lora_adapter; rollout.lora_sync=adapter), one adapter and the base in a batch.
    `host`: the address it listens on (a server host's, server_host.py, is its node's, for a rollout actor on
    another node)."""
    managed = managed_args(extra_args)
    if managed:
        raise ValueError(f"extra SGLang arguments {', '.join(managed)}: megarl sets these itself")
    if deterministic and attention_backend(extra_args) not in DETERMINISTIC_ATTENTION_BACKENDS:
        raise ValueError(f"deterministic inference needs attention backend {' / '.join(DETERMINISTIC_ATTENTION_BACKENDS)}"
                         f", the extra arguments ask for {attention_backend(extra_args)}")
    port, graph_rows = free_port(), decode_graph_rows(decode_rows)
    vision, vision_env = vision_args(model_path, tp)
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
               "--host", host, "--port", str(port), "--tp-size", str(tp),
               "--base-gpu-id", str(gpu), "--mem-fraction-static", str(mem_fraction), "--dtype", dtype,
               "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
               "--custom-weight-loader", sglang_loader.PERSISTENT_LOADER,
               *(["--enable-memory-saver"] if memory_saver else []),
               *(["--enable-deterministic-inference"] if deterministic else []),
               *(["--enable-fp32-lm-head"] if fp32_lm_head else []),
               *(["--enable-return-routed-experts"] if routed_experts else []),
               *(["--enable-lora", "--max-lora-rank", str(lora[0]), "--lora-target-modules", *lora[1],
                  "--max-loras-per-batch", "2"] if lora else []),
               *(["--load-format", load_format] if load_format else []),
               *([] if cuda_graph else ["--disable-cuda-graph"]),
               *(["--cuda-graph-max-bs-decode", str(graph_rows)] if cuda_graph and graph_rows else []),
               *allreduce_fusion_args(tp, extra_args), *vision,
               *map(str, extra_args)]
    log = Path(log_dir or tempfile.gettempdir()) / f"sglang_{port}.log"
    env = vision_env | dict(env or {}) | ({"CUDA_VISIBLE_DEVICES": ",".join(visible_devices)} if visible_devices else {})
    return SGLangServer(command, port, tp, str(log), env=env, host=host, **kwargs)
