"""A stand-in SGLang HTTP server for CPU tests of megarl.rollout.sglang (run as a script: its own process,
so dying and restarting are real). It speaks sglang 0.5.17's JSON for the endpoints megarl uses:

- GET /health: 200 (503 with --never-healthy).
- POST /generate {input_ids: [[...]], sampling_params (one, or one per row), return_logprob}: one output per
  row (HTTP 400 with sglang's message for a row whose prompt + max_new_tokens passes --context-length),
  {"output_ids", "meta_info": {"finish_reason": {"type": "stop", "matched"} | {"type": "length", "length"}
  | {"type": "abort", ...}, "output_token_logprobs": [[logprob, token, None], ...], ...}}.
  Tokens are a deterministic function of the prompt and a per-process row counter (so n samples differ); with a
  sampling_seed, of the seed and the token's position alone (as SGLang's seeded sampler: a request continued
  from prompt + its tokens so far draws what it would have drawn uninterrupted). An aborted request answers with
  half of its max_new_tokens.
  With "stream": true, the same outputs as server-sent events, one per row per token (its "index" in a batch),
  each with the row's tokens so far (with the fake config incremental_streaming_output, only the new one: SGLang's
  --incremental-streaming-output), finish_reason null until the row's last; then `data: [DONE]`.
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
- POST /weights_checker {action: snapshot | reset_tensors | compare}, /update_weights_from_disk {model_path}:
  what megarl.rollout.sglang_server.verify_inside_sglang uses (per TP rank).
With --tp N --model-path DIR the server has N TP ranks (`tp_model`: SGLang's sharding and presharded loading;
a DeepSeek config.json: fake_sglang_deepseek.DeepseekRank, with --ep-size E SGLang's expert-parallel placement),
payload r of a weight update loads into rank r. Test controls: POST /fake/config {"generate_delay", "hang",
"die_on_generate", "corrupt": [rank, name] (after each weight update, one element of that rank's tensor is off)}; GET /fake/log (the requests received); GET /fake/weights[?rank=r] (name -> [dtype, shape,
sha1 of the bytes]).
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

    def named_parameters(self):
        return iter(self.weights.items())


def tp_model(hf: dict, rank: int, tp: int):
    """One TP rank of a fake TP server of a Qwen2-style model (--model-path with --tp): SGLang's weight loading
    semantics, written here from SGLang 0.5.17's layers (not from megarl's inventory). Full tensors are narrowed to
    the rank's shard; with a layer's `use_presharded_weights` on, the tensor must be the shard itself and is
    copied as is (SGLang's assertions and words on a wrong shape). Shards: q/k/v and gate/up rows (K/V heads at
    TP above their count: the rank's one head), o/down columns, embed/lm_head rows of the vocabulary padded to a
    multiple of 64 (presharded: exactly vocab // tp rows, VocabParallelEmbedding's assertion); the rest whole."""
    import torch

    class Layer(torch.nn.Module):  # the kind of SGLang layer a tensor loads into, carrying its presharded switch
        def __init__(self):
            super().__init__()
            self.use_presharded_weights = False

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.column, self.row, self.vocab = Layer(), Layer(), Layer()
            self.weights = {}

        def named_parameters(self, *args, **kwargs):
            """The parameters as SGLang's layers hold what was loaded: q/k/v and gate/up concatenated into
            qkv_proj and gate_up_proj (QKVParallelLinear, MergedColumnParallelLinear), the vocabulary rows
            padded with zero rows to the rank's share of a vocabulary padded to a multiple of 64."""
            held, fused = dict(self.weights), {}
            for name in list(held):
                for parts, into in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
                    if parts[0] in name:
                        names = [name.replace(parts[0], part) for part in parts]
                        if all(n in held for n in names):
                            fused[name.replace(parts[0], into)] = torch.cat([held.pop(n) for n in names])
            for name, t in held.items():
                if "embed_tokens" in name or "lm_head" in name:
                    per = -(-SHAPES[name][0] // 64) * 64 // tp
                    t = torch.cat([t, t.new_zeros(per - t.shape[0], *t.shape[1:])])
                fused[name] = t
            return iter(fused.items())

        def shard(self, name: str, length: int):
            """(layer, dim, lo, hi) of this rank's shard, None for a replicated tensor."""
            heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
            if "embed_tokens" in name or "lm_head" in name:
                per = -(-length // 64) * 64 // tp
                return self.vocab, 0, rank * per, min((rank + 1) * per, length)
            if any(k in name for k in ("k_proj", "v_proj")) and kv < tp:
                head = rank // (tp // kv)
                return self.column, 0, head * length // kv, (head + 1) * length // kv
            if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                return self.column, 0, rank * length // tp, (rank + 1) * length // tp
            if any(k in name for k in ("o_proj.weight", "down_proj.weight")):
                return self.row, 1, rank * length // tp, (rank + 1) * length // tp
            return None

        def load_weights(self, named):
            for name, tensor in named:
                full = SHAPES[name]
                cut = self.shard(name, full[0] if "o_proj" not in name and "down_proj" not in name else full[1])
                if cut is None:
                    assert tensor.shape == full, f"param_data.shape={full} loaded_weight.shape={tensor.shape}"
                    self.weights[name] = tensor.clone()
                    continue
                layer, dim, lo, hi = cut
                if layer is self.vocab and layer.use_presharded_weights:
                    assert tensor.shape[0] == full[0] // tp, (
                        f"self.org_vocab_size={full[0]} self.use_presharded_weights=True "
                        f"loaded_weight.shape[output_dim]={tensor.shape[0]}")
                elif not layer.use_presharded_weights:
                    assert tensor.shape == full, f"param_data.shape={full} loaded_weight.shape={tensor.shape}"
                    tensor = tensor.narrow(dim, lo, hi - lo)
                shape = list(full)
                shape[dim] = hi - lo
                assert list(tensor.shape) == shape, f"param_data.shape={shape} loaded_weight.shape={tensor.shape}"
                self.weights[name] = tensor.clone()

    from megarl.reshard.inventory import hf_inventory  # the HF tensors' full shapes only

    SHAPES = {s.name: torch.Size(s.shape) for s in hf_inventory(hf)}
    return Model()


class State:
    def __init__(self):
        self.config = {"generate_delay": 0.0, "hang": False, "die_on_generate": False}
        self.log, self.rows, self.model = [], 0, DictModel()
        self.ranks = []  # a TP server's per-rank models (--tp with --model-path): payload r loads into rank r
        self.snapshot = None  # /weights_checker's
        self.model_path = None
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
        max_new, stops, seed = sp.get("max_new_tokens", 128), set(sp.get("stop_token_ids") or []), sp.get("sampling_seed")
        with STATE.lock:
            STATE.rows += 1
            counter = STATE.rows
        tokens, reason = [], {"type": "length", "length": max_new}
        for j in range(max_new // 2 if aborted else max_new):
            token = (sum(row) + 31 * counter + 13 * j) % VOCAB if seed is None else (7 * seed + 13 * (len(row) + j)) % VOCAB
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
    from megarl.rollout.transports import sglang_loader  # torch: imported on first use, so start-up is quick

    payloads = body["serialized_named_tensors"]
    if STATE.ranks and len(payloads) != len(STATE.ranks):
        return {"success": False, "message": f"{len(payloads)} payloads for tp_size={len(STATE.ranks)}"}
    for rank, payload in enumerate(payloads):  # every TP rank's own (a dict model loads each)
        named = pickle.loads(base64.b64decode(payload))
        named = [(name, tensor.to("cpu")) for name, tensor in named]  # as SGLang: to the rank's device first
        model = STATE.ranks[rank] if STATE.ranks else STATE.model
        try:
            if body.get("load_format") == sglang_loader.PERSISTENT_LOADER:
                sglang_loader.load_flat_bucket(model, named)
            elif body.get("load_format") is None:
                model.load_weights(named)
            else:
                return {"success": False, "message": f"Unknown load_format={body.get('load_format')}"}
        except Exception as error:  # SGLang answers a failed load with its message
            return {"success": False, "message": f"Failed to update weights: {error}"}
    if STATE.config.get("corrupt"):  # [rank, name]: that rank's copy of the tensor is off by one element
        rank, name = STATE.config["corrupt"]
        if name in STATE.ranks[rank].weights:
            STATE.ranks[rank].weights[name].view(-1)[0] += 1
    return {"success": True, "message": "Success"}


def weights_checker(body: dict) -> dict:
    """SGLang's weights checker per TP rank: snapshot, reset_tensors (noise), compare (names every difference)."""
    import torch

    ranks = STATE.ranks or [STATE.model]
    if body["action"] == "snapshot":
        STATE.snapshot = [{n: t.clone() for n, t in m.weights.items()} for m in ranks]
    elif body["action"] == "reset_tensors":
        for m in ranks:
            m.weights = {n: torch.randn(t.shape).to(t.dtype) for n, t in m.weights.items()}
    elif body["action"] == "compare":
        wrong = [f"rank {r} {n}" for r, (m, snap) in enumerate(zip(ranks, STATE.snapshot)) for n, t in snap.items()
                 if n not in m.weights or not torch.equal(m.weights[n].view(-1).view(torch.uint8),
                                                          t.view(-1).view(torch.uint8))]
        if wrong:
            return {"success": False, "message": f"check tensor equality failed: {wrong}"}
    return {"success": True, "message": ""}


def update_weights_from_disk(body: dict) -> dict:
    """The model's safetensors loaded by each TP rank's default path (full tensors, narrowed)."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(body["model_path"], "model.safetensors"))
    for m in STATE.ranks or [STATE.model]:
        m.load_weights(weights.items())
    return {"success": True, "message": "Succeeded to update model weights."}


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

    from megarl.rollout.transports import flat_bucket

    group = STATE.groups.get(body["group_name"])
    if group is None:
        return {"success": False, "message": f"Group {body['group_name']} not in model_update_group"}
    empty = [(n, torch.empty(s, dtype=getattr(torch, d), device="meta"))
             for n, d, s in zip(body["names"], body["dtypes"], body["shapes"])]
    if body.get("load_format") == "flattened_bucket":
        layout, size = flat_bucket.flat_layout(empty)
        flat = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(flat, group_src=0, group=group)
        STATE.model.load_weights(flat_bucket.unpack(flat, layout))
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
                      "/destroy_weights_update_group": destroy_weights_group,
                      "/weights_checker": weights_checker, "/update_weights_from_disk": update_weights_from_disk}


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

    def stream(self, outputs: list[dict] | dict):
        """A streamed /generate's events (the module's docstring), rows interleaved token by token."""
        rows = outputs if isinstance(outputs, list) else [outputs]
        incremental = STATE.config.get("incremental_streaming_output")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for j in range(max(max(len(out["output_ids"]) for out in rows), 1)):
            for i, out in enumerate(rows):
                tokens, meta = out["output_ids"], out["meta_info"]
                if j >= max(len(tokens), 1):
                    continue
                last = j >= len(tokens) - 1
                pairs = meta["output_token_logprobs"]
                event = {"output_ids": tokens[j:j + 1] if incremental else tokens[:j + 1],
                         "meta_info": meta | {"finish_reason": meta["finish_reason"] if last else None,
                                              "completion_tokens": min(j + 1, len(tokens)),
                                              "output_token_logprobs": pairs[j:j + 1] if incremental else
                                              pairs[:j + 1]}}
                if isinstance(outputs, list):
                    event["index"] = i
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def do_GET(self):
        if self.path == "/health":
            return self.reply(503 if self.never_healthy else 200, ...)
        if self.path == "/fake/log":
            return self.reply(200, STATE.log)
        if self.path == "/fake/mapped":  # the persistent loader's buffers held mapped, by slot
            from megarl.rollout.transports import sglang_loader
            return self.reply(200, sorted(sglang_loader._MAPPED))
        if self.path.startswith("/fake/weights"):  # ?rank=r: TP rank r's
            rank = int(self.path.partition("rank=")[2] or 0)
            model = STATE.ranks[rank] if STATE.ranks else STATE.model
            held = model.weights if hasattr(model, "weights") else dict(model.named_parameters())
            return self.reply(200, {n: digest(t) for n, t in held.items()})
        self.reply(404, {"detail": "Not Found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.path = self.path.partition("?")[0]  # a query (/flush_cache?timeout=...) is not logged
        if self.path == "/fake/config":
            STATE.config.update(body)
            return self.reply(200, STATE.config)
        STATE.log.append({"path": self.path, "body": body if self.path != "/update_weights_from_tensor" else
                          {k: v for k, v in body.items() if k != "serialized_named_tensors"}})
        if self.path == "/generate":
            STATE.aborted.clear()
            try:
                if body.get("stream"):
                    return self.stream(generate(body))
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
        if self.path == "/freeze_gc":
            return self.reply(200, text="Garbage collection frozen.\n")
        if self.path == "/update_weights_from_tensor" or self.path in WEIGHT_GROUP_PATHS:
            result = WEIGHT_GROUP_PATHS.get(self.path, update_weights)(body)
            return self.reply(200 if result["success"] else 400, result)
        self.reply(404, {"detail": "Not Found"})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="the address it listens on")
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--context-length", type=int, default=STATE.context_length)
    parser.add_argument("--tp", type=int, default=1, help="with --model-path: a TP server (tp_model per rank)")
    parser.add_argument("--model-path", default=None, help="a Qwen2-style or DeepSeek HF directory (its config.json)")
    parser.add_argument("--ep-size", type=int, default=1, help="with a DeepSeek --model-path: SGLang's expert parallelism")
    args = parser.parse_args()
    if args.model_path:
        with open(os.path.join(args.model_path, "config.json")) as f:
            hf = json.load(f)
        if hf["model_type"].startswith("deepseek"):
            from tests.rollout.fake_sglang_deepseek import DeepseekRank
            STATE.ranks = [DeepseekRank(hf, r, args.tp, ep=args.ep_size) for r in range(args.tp)]
        else:
            STATE.ranks = [tp_model(hf, r, args.tp) for r in range(args.tp)]
    Handler.never_healthy = args.never_healthy
    STATE.context_length = args.context_length
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
