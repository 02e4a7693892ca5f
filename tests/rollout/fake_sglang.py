"""A stand-in SGLang HTTP server for CPU tests of megarl.rollout.sglang (run as a script: its own process,
so dying and restarting are real). It speaks sglang 0.5.17's JSON for the endpoints megarl uses:

- GET /health: 200 (503 with --never-healthy).
- POST /generate {input_ids: [[...]], sampling_params (one, or one per row), return_logprob}: one output per
  row (HTTP 400 with sglang's message for a row whose prompt + max_new_tokens passes --context-length),
  {"output_ids", "meta_info": {"finish_reason": {"type": "stop", "matched"} | {"type": "length", "length"}
  | {"type": "abort", ...}, "output_token_logprobs": [[logprob, token, None], ...], ...}}.
  Tokens are a deterministic function of the prompt and a per-process row counter (so n samples differ).
- POST /abort_request {abort_all}: empty 200; requests waiting in a slow /generate finish as aborted.
- /release_memory_occupation, /resume_memory_occupation {tags}: null; /flush_cache: plain text.
- POST /update_weights_from_tensor {serialized_named_tensors, load_format, flush_cache}: each payload
  decoded with cuda_ipc.plain_serializer's format and loaded like SGLang would (default loader or
  megarl's custom loader) into a dict model.
- POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}:
  this server's one TP rank joins the group (nccl_broadcast.weight_group; gloo on CPU) as rank rank_offset.
- POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, load_format}: the
  broadcast received into one flat buffer ("flattened_bucket") or a tensor per name (null), then loaded.
- POST /destroy_weights_update_group {group_name}.
Test controls: POST /fake/config {"generate_delay", "hang", "die_on_generate"}; GET /fake/log (the
requests received); GET /fake/weights (name -> [dtype, shape, sha1 of the bytes]).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 1000


class DictModel:
    def __init__(self):
        self.weights = {}

    def load_weights(self, named):
        for name, tensor in named:
            self.weights[name] = tensor.clone()


class State:
    def __init__(self):
        self.config = {"generate_delay": 0.0, "hang": False, "die_on_generate": False}
        self.log, self.rows, self.model = [], 0, DictModel()
        self.groups = {}  # weight groups by name
        self.aborted = threading.Event()
        self.lock = threading.Lock()
        self.context_length = 1 << 20


class ContextTooLong(ValueError):
    pass


STATE = State()


def generate(body: dict) -> list[dict]:
    cfg = STATE.config
    if cfg["die_on_generate"]:
        os._exit(3)
    if cfg["hang"]:
        time.sleep(3600)
    ids = body["input_ids"]
    rows = ids if ids and isinstance(ids[0], list) else [ids]
    per_row = body.get("sampling_params") or {}
    per_row = per_row if isinstance(per_row, list) else [per_row] * len(rows)
    for row, sp in zip(rows, per_row):
        wanted = len(row) + sp.get("max_new_tokens", 128)
        if wanted > STATE.context_length:  # sglang 0.5.17's check and its words
            raise ContextTooLong(f"Requested token count exceeds the model's maximum context length of "
                                 f"{STATE.context_length} tokens. You requested a total of {wanted} tokens")
    deadline = time.monotonic() + cfg["generate_delay"]
    aborted = False
    while time.monotonic() < deadline:
        if STATE.aborted.is_set():
            aborted = True
            break
        time.sleep(0.01)
    outputs = []
    for row, sp in zip(rows, per_row):
        max_new, stops = sp.get("max_new_tokens", 128), set(sp.get("stop_token_ids") or [])
        with STATE.lock:
            STATE.rows += 1
            counter = STATE.rows
        tokens, reason = [], {"type": "length", "length": max_new}
        for j in range(max_new // 2 if aborted else max_new):
            token = (sum(row) + 31 * counter + 13 * j) % VOCAB
            tokens.append(token)
            if token in stops and not sp.get("ignore_eos"):
                reason = {"type": "stop", "matched": token}
                break
        if aborted:
            reason = {"type": "abort", "message": "Abort in waiting queue", "status_code": None, "err_type": None}
        outputs.append({"output_ids": tokens, "meta_info": {
            "id": f"req{counter}", "finish_reason": reason, "prompt_tokens": len(row), "completion_tokens": len(tokens),
            "output_token_logprobs": [[-0.05 - (t % 10) / 10, t, None] for t in tokens]}})
    return outputs if rows is ids else outputs[0]


def update_weights(body: dict) -> dict:
    from megarl.rollout.transports import cuda_ipc  # torch: imported on first use, so start-up is quick

    for payload in body["serialized_named_tensors"]:  # every TP rank's copy: each is loaded (a dict model)
        named = pickle.loads(base64.b64decode(payload))
        named = [(name, tensor.to("cpu")) for name, tensor in named]  # as SGLang: to the rank's device first
        if body.get("load_format") == cuda_ipc.PERSISTENT_LOADER:
            cuda_ipc.load_flat_bucket(STATE.model, named)
        elif body.get("load_format") is None:
            STATE.model.load_weights(named)
        else:
            return {"success": False, "message": f"Unknown load_format={body.get('load_format')}"}
    return {"success": True, "message": "Success"}


def init_weights_group(body: dict) -> dict:
    from megarl.rollout.transports.nccl_broadcast import weight_group

    if body["group_name"] in STATE.groups:  # SGLang's refusal of a name it holds
        return {"success": False, "message": f"group {body['group_name']} already exists"}
    STATE.groups[body["group_name"]] = weight_group(
        body["backend"], f"tcp://{body['master_address']}:{body['master_port']}", body["world_size"],
        body["rank_offset"], body["group_name"])
    return {"success": True, "message": "Succeeded to initialize custom process group."}


def update_weights_from_distributed(body: dict) -> dict:
    import torch
    import torch.distributed as dist

    from megarl.rollout.transports import cuda_ipc

    group = STATE.groups.get(body["group_name"])
    if group is None:
        return {"success": False, "message": f"Group {body['group_name']} not in model_update_group"}
    empty = [(n, torch.empty(s, dtype=getattr(torch, d), device="meta"))
             for n, d, s in zip(body["names"], body["dtypes"], body["shapes"])]
    if body.get("load_format") == "flattened_bucket":
        layout, size = cuda_ipc.flat_layout(empty)
        flat = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(flat, group_src=0, group=group)
        STATE.model.load_weights(cuda_ipc.unpack(flat, layout))
    elif body.get("load_format") is None:
        named = [(n, torch.empty_like(t, device="cpu")) for n, t in empty]
        for _, t in named:
            dist.broadcast(t, group_src=0, group=group)
        STATE.model.load_weights(named)
    else:
        return {"success": False, "message": f"Unknown load_format={body.get('load_format')}"}
    return {"success": True, "message": "Succeeded to update parameter online."}


def destroy_weights_group(body: dict) -> dict:
    import torch.distributed as dist

    group = STATE.groups.pop(body["group_name"], None)
    if group is None:
        return {"success": False, "message": f"Group {body['group_name']} not in model_update_group"}
    dist.destroy_process_group(group)
    return {"success": True, "message": "Succeeded to destroy custom process group."}


WEIGHT_GROUP_PATHS = {"/init_weights_update_group": init_weights_group,
                      "/update_weights_from_distributed": update_weights_from_distributed,
                      "/destroy_weights_update_group": destroy_weights_group}


def digest(t) -> list:
    import torch

    data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype), list(t.shape), hashlib.sha1(data).hexdigest()]


class Handler(BaseHTTPRequestHandler):
    never_healthy = False

    def log_message(self, *args):
        pass

    def reply(self, code: int, body=None, text: str | None = None):
        data = text.encode() if text is not None else (b"" if body is ... else json.dumps(body).encode())
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self.reply(503 if self.never_healthy else 200, ...)
        if self.path == "/fake/log":
            return self.reply(200, STATE.log)
        if self.path == "/fake/weights":
            return self.reply(200, {n: digest(t) for n, t in STATE.model.weights.items()})
        self.reply(404, {"detail": "Not Found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/fake/config":
            STATE.config.update(body)
            return self.reply(200, STATE.config)
        STATE.log.append({"path": self.path, "body": body if self.path != "/update_weights_from_tensor" else
                          {k: v for k, v in body.items() if k != "serialized_named_tensors"}})
        if self.path == "/generate":
            STATE.aborted.clear()
            try:
                return self.reply(200, generate(body))
            except ContextTooLong as e:
                return self.reply(400, {"error": {"message": str(e)}})
        if self.path == "/abort_request":
            if body.get("abort_all"):
                STATE.aborted.set()
            return self.reply(200, ...)
        if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return self.reply(200, None)
        if self.path == "/flush_cache":
            return self.reply(200, text="Cache flushed.\n")
        if self.path == "/update_weights_from_tensor" or self.path in WEIGHT_GROUP_PATHS:
            result = WEIGHT_GROUP_PATHS.get(self.path, update_weights)(body)
            return self.reply(200 if result["success"] else 400, result)
        self.reply(404, {"detail": "Not Found"})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--context-length", type=int, default=STATE.context_length)
    args = parser.parse_args()
    Handler.never_healthy = args.never_healthy
    STATE.context_length = args.context_length
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
