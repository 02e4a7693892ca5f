"""Rollouts from real SGLang servers (GPU): one `python -m sglang.launch_server` process per generation
TP group, owned by this engine.

- Start-up waits for /health with a deadline and fails with the tail of the server's log.
- generate(): token ids in, token ids and per-token log-probs out (SGLang's `output_token_logprobs`,
  under the raw logits as base.py requires at temperature 1), n samples per prompt, stop tokens.
  Rows are spread over the servers, least-loaded first; a conversation id keeps a multi-turn
  conversation on one server (its prefix cache). A request to a server that died restarts it and
  is retried once; every HTTP call has a timeout.
- Weights: full HF-named tensors per bucket (SGLang slices its own TP shard) through a transport:
  CUDA IPC when colocated (transports/cuda_ipc.py), NCCL broadcast when disaggregated
  (transports/nccl_broadcast.py, driven by the trainer rank that owns the group).
- Colocated memory: after each generate the KV cache is released (the trainer gets that memory
  back); the next generate resumes it first and flushes the prefix cache if weights changed.
  release_memory() also drops the weights (SGLang keeps no copy): they must be pushed again.
- Verification inside SGLang (`verify_weights`): the weights SGLang received are snapshotted by its
  own weights checker, reset to noise, reloaded by SGLang's own loader from a file of the exported
  tensors, and compared by the checker; any difference fails with SGLang's message.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import requests
import torch

from megarl.rollout.base import Generation, RolloutEngine, SamplingParams
from megarl.rollout.transports import cuda_ipc


class SGLangError(RuntimeError):
    """A server failed to start, died, or answered a request with an error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangServer:
    """One SGLang HTTP server process on GPUs [gpu, gpu + tp)."""

    def __init__(self, model_path: str, tp: int = 1, gpu: int = 0, mem_fraction: float = 0.5,
                 memory_saver: bool = True, load_format: str | None = None, cuda_graph: bool = True,
                 extra_args: tuple[str, ...] = (), log_dir: str | None = None, startup_timeout: float = 900.0,
                 request_timeout: float = 600.0):
        self.model_path, self.tp, self.gpu = model_path, tp, gpu
        self.startup_timeout, self.request_timeout = startup_timeout, request_timeout
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
                     "--host", "127.0.0.1", "--port", str(self.port), "--tp-size", str(tp),
                     "--base-gpu-id", str(gpu), "--mem-fraction-static", str(mem_fraction),
                     "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                     *(["--enable-memory-saver"] if memory_saver else []),
                     *(["--load-format", load_format] if load_format else []),
                     *([] if cuda_graph else ["--disable-cuda-graph"]), *extra_args]
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"sglang_{self.port}.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> "SGLangServer":
        log = open(self.log_path, "ab")
        # Its own session, so shutdown() can end the server's whole process tree and nothing else.
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SGLangError(f"SGLang server exited with code {self.process.returncode} during start-up:\n"
                                  f"{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.shutdown()
        raise SGLangError(f"SGLang server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def post(self, path: str, payload: dict | None = None, timeout: float | None = None):
        try:
            response = requests.post(self.url + path, json=payload or {}, timeout=timeout or self.request_timeout)
        except requests.RequestException as error:
            raise SGLangError(f"{path} on {self.url} failed: {error}"
                              + ("" if self.alive() else f" (server died)\n{self.log_tail()}")) from error
        if response.status_code != 200:
            raise SGLangError(f"{path} on {self.url}: HTTP {response.status_code}: {response.text[:2000]}")
        try:
            body = response.json()
        except ValueError:  # some endpoints (/flush_cache) answer in plain text
            return response.text
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"{path} on {self.url}: {body.get('message')}")
        return body

    def shutdown(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


class SGLangRolloutEngine(RolloutEngine):
    def __init__(self, model_path: str, num_servers: int = 1, tp: int = 1, colocated: bool = True,
                 verify_dir: str | None = None, sampling_overrides: dict | None = None, **server_kwargs):
        self.model_path, self.colocated = model_path, colocated
        self.sampling_overrides = dict(sampling_overrides or {})  # e.g. ignore_eos for benchmarks
        self.servers = [SGLangServer(model_path, tp=tp, gpu=i * tp, **server_kwargs) for i in range(num_servers)]
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(SGLangServer.start, self.servers))
        self.load = [0] * num_servers  # rows in flight per server
        self.sticky: dict[str, int] = {}
        self.lock = threading.Lock()
        self.kv_released = self.weights_released = self.weights_changed = False
        self.verify_dir = Path(verify_dir) if verify_dir else None
        self.received: dict[str, torch.Tensor] = {}  # CPU copies of this sync's tensors, for verify_weights

    # ---- generation -------------------------------------------------------------------------------

    def _pick(self, conversation: str | None) -> int:
        with self.lock:
            if conversation is not None and conversation in self.sticky:
                return self.sticky[conversation]
            index = min(range(len(self.servers)), key=self.load.__getitem__)
            if conversation is not None:
                self.sticky[conversation] = index
            return index

    def _prepare_for_generation(self) -> None:
        if self.weights_released:
            raise SGLangError("SGLang's weights were released and not pushed again; sync before generating")
        for server in self.servers:
            if self.kv_released:
                server.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
            if self.weights_changed:
                server.post("/flush_cache")
        self.kv_released = self.weights_changed = False

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 conversations: list[str] | None = None) -> list[Generation]:
        if params.max_new_tokens < 1 or params.n < 1:
            raise ValueError(f"max_new_tokens and n must be >= 1, got {params.max_new_tokens} and {params.n}")
        self._prepare_for_generation()
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "stop_token_ids": list(params.stop_token_ids), **self.sampling_overrides}
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        rows = [(i, p) for i, p in enumerate(prompts) for _ in range(params.n)]
        # Chunks of rows per server: one conversation (or, without ids, a share of the batch) each.
        chunks: dict[int, list[int]] = {}
        share = -(-len(rows) // len(self.servers))
        for r, (i, _) in enumerate(rows):
            key = conversations[i] if conversations else None
            server = self._pick(key) if key else (r // share)
            chunks.setdefault(server, []).append(r)
        results: list[Generation | None] = [None] * len(rows)

        def run(server_index: int, row_ids: list[int]) -> None:
            with self.lock:
                self.load[server_index] += len(row_ids)
            try:
                outputs = self._generate_on(server_index, [rows[r][1] for r in row_ids], sampling)
            finally:
                with self.lock:
                    self.load[server_index] -= len(row_ids)
            for r, out in zip(row_ids, outputs):
                results[r] = _to_generation(rows[r][0], out)

        with ThreadPoolExecutor(max(1, len(chunks))) as pool:
            for future in [pool.submit(run, s, ids) for s, ids in chunks.items()]:
                future.result()
        if self.colocated:  # give the KV cache's memory back to the trainer until the next rollout
            for server in self.servers:
                server.post("/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
            self.kv_released = True
        return results

    def _generate_on(self, index: int, input_ids: list[list[int]], sampling: dict) -> list[dict]:
        request = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
        server = self.servers[index]
        try:
            return server.post("/generate", request)
        except SGLangError:
            if server.alive():
                raise
            # The server died: start it again and retry once. Its weights are the checkpoint's, so a
            # trained policy must be pushed again: a colocated trainer does that at the next sync.
            server.start()
            return server.post("/generate", request)

    def abort(self) -> None:
        """Abort every request in flight (e.g. over-sampled work); they finish with reason 'abort'."""
        for server in self.servers:
            server.post("/abort_request", {"abort_all": True})

    # ---- weights ----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        bucket = list(named_tensors)
        if self.weights_released:
            for server in self.servers:
                server.post("/resume_memory_occupation", {"tags": ["weights"]})
            self.weights_released = False
        for server in self.servers:
            cuda_ipc.send_bucket(server, bucket, flush_cache=False)
        self.weights_changed = True
        if self.verify_dir is not None:
            self.received.update((n, t.detach().to("cpu", copy=True)) for n, t in bucket)

    def verify_weights(self) -> None:
        """SGLang checks itself: what it received against what its own loader reads from the exported file."""
        if self.verify_dir is None:
            raise SGLangError("verify_weights needs the engine built with verify_dir")
        from safetensors.torch import save_file

        directory = self.verify_dir / "exported"
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.received, str(directory / "model.safetensors"))
        for name in os.listdir(self.model_path):  # config and tokenizer files: SGLang's loader reads them
            if not name.endswith(".safetensors") and not (directory / name).exists():
                (directory / name).symlink_to(Path(self.model_path, name).resolve())
        for server in self.servers:
            server.post("/weights_checker", {"action": "snapshot"})
            server.post("/weights_checker", {"action": "reset_tensors"})
            server.post("/update_weights_from_disk", {"model_path": str(directory), "flush_cache": True})
            server.post("/weights_checker", {"action": "compare"})

    def named_weights(self) -> dict[str, torch.Tensor]:
        """After verify_weights passed, SGLang holds exactly these tensors (the trainer's digest check
        then covers the hop from the trainer to this process)."""
        self.verify_weights()
        received, self.received = self.received, {}
        return received

    # ---- memory -----------------------------------------------------------------------------------

    def release_memory(self) -> None:
        for server in self.servers:
            server.post("/release_memory_occupation", {})
        self.kv_released = self.weights_released = True

    def resume_memory(self) -> None:
        """Weights memory back (its values are not: push weights next); the KV cache comes back at generate."""
        for server in self.servers:
            server.post("/resume_memory_occupation", {"tags": ["weights"]})
        self.weights_released = False

    def shutdown(self) -> None:
        for server in self.servers:
            server.shutdown()


def _to_generation(prompt_index: int, out: dict) -> Generation:
    meta = out["meta_info"]
    pairs = meta["output_token_logprobs"]  # [logprob, token id, text] per generated token
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    return Generation(prompt_index=prompt_index, token_ids=[int(p[1]) for p in pairs],
                      logprobs=[float(p[0]) for p in pairs], finish_reason="length" if reason == "length" else
                      "stop" if reason == "stop" else reason)
