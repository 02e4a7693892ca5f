"""megarl's SGLang engine logic (routing, n samples, stop params, restarts, timeouts, abort, weight
payloads) against fake_sglang.py: real HTTP servers in their own processes speaking sglang 0.5.17's JSON."""

import gc
import io
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from megarl.rollout import sglang as sglang_module
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang import SGLangRolloutEngine
from megarl.rollout.sglang_server import SGLangError, SGLangServer, free_port, gc_paused, sglang_server
from megarl.rollout.transports import cuda_ipc, flat_bucket, sglang_loader
from megarl.workers.sync_checks import tensor_digest
from megarl.workers.weight_sync import send_overlapped

FAKE = str(Path(__file__).with_name("fake_sglang.py"))
REPO = str(Path(__file__).resolve().parents[2])


def fake_server(tmp_path, *flags, **kwargs):
    port = free_port()
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    return SGLangServer([sys.executable, FAKE, "--port", str(port), *flags], port, log_path=str(tmp_path / f"{port}.log"),
                        startup_timeout=kwargs.pop("startup_timeout", 30), **kwargs)


def engine(tmp_path, servers=1, flags=(), **kwargs):
    timeout = kwargs.pop("request_timeout", 30)
    return SGLangRolloutEngine("unused", num_servers=servers, colocated=kwargs.pop("colocated", False),
                               launch=lambda i: fake_server(tmp_path, *flags, request_timeout=timeout), **kwargs)


def log(server, path=None):
    entries = requests.get(server.url + "/fake/log", timeout=5).json()
    return [e for e in entries if path is None or e["path"] == path]


def configure(server, **config):
    requests.post(server.url + "/fake/config", json=config, timeout=5).raise_for_status()


@pytest.fixture
def three(tmp_path):
    e = engine(tmp_path, servers=3)
    yield e
    e.shutdown()


def test_least_loaded_routing_n_samples_and_stickiness(three):
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11], [12, 13]]
    params = SamplingParams(max_new_tokens=5, n=3, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[999],
                            seed=4)
    gens = three.generate(prompts, params)
    assert [g.prompt_index for g in gens] == [i for i in range(len(prompts)) for _ in range(3)]
    assert all(len(g.token_ids) == len(g.logprobs) == 5 for g in gens)
    assert all(g.logprobs[k] == -0.05 - (g.token_ids[k] % 10) / 10 for g in gens for k in range(5))
    # the n samples of a prompt are distinct rows, all sent to the same server (shared prefix)
    assert len({tuple(g.token_ids) for g in gens[:3]}) == 3
    rows_per_server = []
    for server in three.servers:
        (request,) = log(server, "/generate")
        rows = request["body"]["input_ids"]
        assert all(rows[k] == rows[k - k % 3] for k in range(len(rows)))
        assert request["body"]["return_logprob"] is True
        assert request["body"]["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                                                      "top_k": 20, "stop_token_ids": [999], "ignore_eos": False}
        rows_per_server.append(len(rows))
    assert rows_per_server == [6, 6, 6]  # least-loaded: the batch is spread evenly
    assert all(s.load == 0 for s in three.state)

    # conversations stick to their server across calls, whatever the load
    convs = ["a", "b", "c", "a"]
    three.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=2), conversations=convs)
    first = dict(three.sticky)
    for _ in range(2):
        three.generate([[5]], SamplingParams(max_new_tokens=2), conversations=["a"])
    assert three.sticky == first and len(set(first.values())) == 3
    a = first["a"]
    assert [len(r["body"]["input_ids"]) for r in log(three.servers[a], "/generate")[1:]] == [2, 1, 1]
    # top_k off (SamplingParams' -1; 0 too) is SGLang's -1: every token (SGLang refuses 0)
    assert log(three.servers[a], "/generate")[-1]["body"]["sampling_params"]["top_k"] == -1
    three.generate([[5]], SamplingParams(max_new_tokens=2, top_k=0), conversations=["a"])
    assert log(three.servers[a], "/generate")[-1]["body"]["sampling_params"]["top_k"] == -1


def test_rows_split_into_concurrent_requests_keep_samples_together_and_order(tmp_path):
    whole, split = engine(tmp_path), engine(tmp_path, rows_per_request=5)
    try:
        prompts = [[1, 2], [4], [4, 5, 6], [7], [8, 9]]  # sums differ, and not by multiples of 31
        params = SamplingParams(max_new_tokens=4, n=2, seed=1)
        gens = split.generate(prompts, params)
        sizes = sorted(len(r["body"]["input_ids"]) for r in log(split.servers[0], "/generate"))
        assert sizes == [2, 4, 4]  # 5 rows at most per request: 2 prompts x n=2, never a prompt's samples apart
        reference = whole.generate(prompts, params)
        assert [g.prompt_index for g in gens] == [g.prompt_index for g in reference] == [i for i in range(5) for _ in "ab"]
        # each answer came from its own prompt: the fake's first token is sum(prompt) + 31 x its row counter
        assert all((g.token_ids[0] - sum(prompts[g.prompt_index])) % 31 == 0 for g in gens)
        assert len({tuple(g.token_ids) for g in gens}) == 10 and split.state[0].load == 0
    finally:
        whole.shutdown()
        split.shutdown()


def test_answers_are_converted_with_the_collector_paused_until_the_last_thread_leaves(tmp_path):
    server = fake_server(tmp_path).start()
    try:
        request = {"input_ids": [[1, 2]], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
        assert server.post("/generate", request, convert=lambda body: (len(body), gc.isenabled())) == (1, False)
        assert gc.isenabled()
    finally:
        server.shutdown()
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with gc_paused():
            inside.set()
            leave.wait(10)
    worker = threading.Thread(target=other_thread)
    with gc_paused():
        worker.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread is still parsing
    leave.set()
    worker.join()
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), gc_paused():
        1 / 0
    assert gc.isenabled()
    gc.disable()  # a caller that turned the collector off keeps it off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_stop_token_and_finish_reasons(tmp_path):
    e = engine(tmp_path)
    try:
        stop = 31 * 1 + 13 * 3  # the fake's token at position 3 of its first row
        g = e.generate([[0]], SamplingParams(max_new_tokens=8, stop_token_ids=[stop]))[0]
        assert g.finish_reason == "stop" and g.token_ids[-1] == stop and len(g.token_ids) == 4
        assert e.generate([[0]], SamplingParams(max_new_tokens=3))[0].finish_reason == "length"
        with pytest.raises(ValueError, match="n must be >= 1"):
            e.generate([[0]], SamplingParams(n=0))
    finally:
        e.shutdown()


def test_token_limits_per_prompt_keep_every_row_inside_the_context(tmp_path):
    """Multi-turn rollouts batch turns of different lengths: one shared limit would push the long prompt
    past the context, which SGLang refuses (HTTP 400); a limit per prompt fits each row."""
    e = engine(tmp_path, flags=("--context-length", "16"))
    try:
        prompts, params = [[1] * 12, [2] * 3], SamplingParams(max_new_tokens=10, n=2)
        with pytest.raises(SGLangError, match="maximum context length of 16"):
            e.generate(prompts, params)
        gens = e.generate(prompts, params, max_new_tokens=[4, 10])
        assert [len(g.token_ids) for g in gens] == [4, 4, 10, 10]
        assert all(g.finish_reason == "length" for g in gens)
        with pytest.raises(ValueError, match="1 token limits for 2 prompts"):
            e.generate(prompts, params, max_new_tokens=[4])
    finally:
        e.shutdown()


def test_dead_server_is_restarted_and_its_requests_retried(tmp_path):
    e = engine(tmp_path, servers=2)
    try:
        first_pid = e.servers[0].process.pid
        configure(e.servers[0], die_on_generate=True)
        gens = e.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=4, n=2))
        assert len(gens) == 8 and all(len(g.token_ids) == 4 for g in gens)
        assert e.restarts == 1 and e.servers[0].alive() and e.servers[0].process.pid != first_pid
        assert len(log(e.servers[0], "/generate")) == 1  # before any sync: retried on the restarted server

        # after a sync the restarted server would generate with its checkpoint weights: retry elsewhere
        e.begin_weight_update()
        configure(e.servers[0], die_on_generate=True)
        gens = e.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=4))
        assert len(gens) == 4 and e.restarts == 2
        assert e.state[0].version == 0 and e.state[1].version == e.version
        assert len(log(e.servers[0], "/generate")) == 0
        e.generate([[5], [6]], SamplingParams(max_new_tokens=2))  # routing avoids the stale server
        assert len(log(e.servers[0], "/generate")) == 0
        e.begin_weight_update()  # the next sync brings it back
        e.generate([[5], [6]], SamplingParams(max_new_tokens=2))
        assert len(log(e.servers[0], "/generate")) == 1
    finally:
        e.shutdown()


def test_single_server_restarted_after_a_sync_fails_loudly(tmp_path):
    e = engine(tmp_path)
    try:
        e.begin_weight_update()
        configure(e.servers[0], die_on_generate=True)
        with pytest.raises(SGLangError, match="restarted with its checkpoint weights"):
            e.generate([[1]], SamplingParams(max_new_tokens=2))
        assert e.servers[0].alive()
    finally:
        e.shutdown()


def test_hung_server_times_out_with_a_clear_error(tmp_path):
    e = engine(tmp_path, request_timeout=1.5)
    try:
        configure(e.servers[0], hang=True)
        start = time.monotonic()
        with pytest.raises(SGLangError, match=r"/generate on http://127.0.0.1:\d+: no answer within 2 s"):
            e.generate([[1]], SamplingParams(max_new_tokens=2))
        assert time.monotonic() - start < 10
    finally:
        e.shutdown()


def test_server_that_never_gets_healthy_fails_start_with_its_log(tmp_path, capsys):
    server = fake_server(tmp_path, "--never-healthy", startup_timeout=2.5, progress_s=1)
    with pytest.raises(SGLangError, match="not healthy after 2 s"):
        server.start()
    assert not server.alive()
    # while it waited, it said so each second, naming the server and its log
    said = [line for line in capsys.readouterr().out.splitlines() if "not up after" in line]
    assert len(said) == 2 and all(server.url in line and str(server.log_path) in line for line in said)
    assert "not up after 1 s of 2;" in said[0] and "not up after 2 s of 2;" in said[1]


def test_abort_ends_requests_in_flight(tmp_path):
    e = engine(tmp_path)
    try:
        configure(e.servers[0], generate_delay=20)
        out = {}
        thread = threading.Thread(target=lambda: out.update(g=e.generate([[1], [2]], SamplingParams(max_new_tokens=6))))
        thread.start()
        time.sleep(0.5)
        start = time.monotonic()
        e.abort()
        thread.join(timeout=10)
        assert not thread.is_alive() and time.monotonic() - start < 5
        assert [g.finish_reason for g in out["g"]] == ["abort", "abort"]
        assert all(len(g.token_ids) == 3 for g in out["g"])
        assert log(e.servers[0], "/abort_request")[0]["body"] == {"abort_all": True}
    finally:
        e.shutdown()


def test_colocated_memory_cycle(tmp_path):
    e = engine(tmp_path, colocated=True)
    try:
        server = e.servers[0]
        e.generate([[1]], SamplingParams(max_new_tokens=2))
        e.release_memory()
        with pytest.raises(SGLangError, match="weights were released"):
            e.generate([[1]], SamplingParams(max_new_tokens=2))
        e.begin_weight_update()
        e.generate([[1]], SamplingParams(max_new_tokens=2))
        calls = [(r["path"], r["body"].get("tags")) for r in log(server) if r["path"] != "/generate"]
        assert calls == [("/freeze_gc", None),  # once healthy: start-up objects out of the collector's reach
                         ("/release_memory_occupation", ["kv_cache", "cuda_graph"]),  # after the 1st rollout
                         ("/release_memory_occupation", ["weights"]),  # release_memory: what is still held
                         ("/resume_memory_occupation", ["weights"]),                # sync begins
                         ("/resume_memory_occupation", ["kv_cache", "cuda_graph"]),  # rollout: KV back (its
                         ("/release_memory_occupation", ["kv_cache", "cuda_graph"])]  # release flushed it)
        e.resume_kv_cache()  # KV cache held through the next sync: its prefixes go stale, so they are flushed
        e.begin_weight_update()
        e.resume_kv_cache()
        assert [r["path"] for r in log(server)][-2:] == ["/resume_memory_occupation", "/flush_cache"]
    finally:
        e.shutdown()


def bucket_of(seed):
    g = torch.Generator().manual_seed(seed)
    return [("model.layers.0.mlp.down_proj.weight", torch.randn(6, 4, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(4, generator=g)),
            ("model.embed_tokens.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)[:, 1:4])]  # a view


@pytest.mark.parametrize("fmt", ["tensors", "persistent"])
def test_weight_payloads_arrive_bitwise_with_overlap(tmp_path, fmt):
    server = fake_server(tmp_path, env={"MEGARL_TIME_WEIGHT_LOADS": "1"}).start()
    try:
        server.tp = 2  # one payload per TP rank, each loaded
        sender = cuda_ipc.CudaIpcSender([server.endpoint()], fmt, serializer=cuda_ipc.plain_serializer)
        buckets = [bucket_of(s) for s in range(5)]
        stats = send_overlapped(iter(buckets), sender.send)
        assert stats["buckets"] == 5 and stats["bytes"] == 5 * (24 * 2 + 4 * 4 + 9 * 2)
        assert len(stats["posts_s"]) == 5 and all(s > 0 for s in stats["posts_s"])
        # the persistent loader times itself when the server's environment asks for it: a line per rank and bucket
        timings = [line for line in server.log_path.read_text().splitlines() if sglang_loader.LOAD_TIMING in line]
        assert len(timings) == (10 if fmt == "persistent" else 0)
        assert all(" bytes 82 " in line for line in timings)
        held = requests.get(server.url + "/fake/weights", timeout=5).json()
        last = buckets[-1]
        for name, t in last:
            dtype, shape, sha = held[name]
            assert [dtype, shape] == [str(t.dtype), list(t.shape)]
            import hashlib
            assert sha == hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        requests_seen = log(server, "/update_weights_from_tensor")
        assert len(requests_seen) == 5
        assert {r["body"]["load_format"] for r in requests_seen} == (
            {None} if fmt == "tensors" else {sglang_loader.PERSISTENT_LOADER})
        if fmt == "persistent":  # two buffers, reused: no allocation per bucket
            assert sender.count == 5 and all(b is not None for b in sender.buffers)
            mapped = lambda: requests.get(server.url + "/fake/mapped", timeout=5).json()
            assert mapped() == [0, 1]
            sender.close()  # SGLang lets go of both buffers first, then ours are freed
            assert mapped() == [] and sender.buffers == [None, None]
            sender.send(buckets[0])()
            server.shutdown()
            sender.close()  # a server that is gone let go with its process
            assert sender.buffers == [None, None]
    finally:
        server.shutdown()


def test_servers_spread_over_the_given_gpus(tmp_path):
    launched = []

    def launch(i):
        launched.append(i)
        return fake_server(tmp_path)

    e = SGLangRolloutEngine("unused", tp=2, gpus=["3", "5", "6", "7"], colocated=False, launch=launch)
    try:
        assert launched == [0, 1] and len(e.servers) == 2  # one server per tp GPUs, whatever num_servers says
    finally:
        e.shutdown()
    with pytest.raises(ValueError, match="3 GPUs .* tensor-parallel size 2"):
        SGLangRolloutEngine("unused", tp=2, gpus=["0", "1", "2"], launch=launch)
    # the second server of tp=2 over those GPUs: base GPU 2 of what it sees, and it sees only those
    server = sglang_server("model", tp=2, gpu=2, visible_devices=["3", "5", "6", "7"], log_dir=str(tmp_path))
    assert server.command[server.command.index("--base-gpu-id") + 1] == "2"
    assert server.env == {"CUDA_VISIBLE_DEVICES": "3,5,6,7"}


def test_extra_arguments_come_last_and_cannot_take_over_megarls_own(tmp_path):
    server = sglang_server("model", extra_args=("--attention-backend", "fa3", "--cuda-graph-max-bs-decode", 512),
                           log_dir=str(tmp_path))
    # argparse keeps the last value: the user's backend replaces megarl's default triton
    assert server.command[-4:] == ["--attention-backend", "fa3", "--cuda-graph-max-bs-decode", "512"]
    assert server.command.index("triton") < len(server.command) - 4
    with pytest.raises(ValueError, match=r"--mem-fraction-static, --port: megarl sets these itself"):
        sglang_server("model", extra_args=("--port=1", "--mem-fraction-static", "0.9"), log_dir=str(tmp_path))


def test_servers_hold_weights_in_the_policys_dtype(tmp_path):
    """SGLang's own choice follows the checkpoint (float16 for a float32 config): a bf16 policy would be converted
    on every load. The server is told the policy's dtype, and no extra argument may change it."""
    def dtype(server):
        return server.command[server.command.index("--dtype") + 1]
    assert dtype(sglang_server("model", log_dir=str(tmp_path))) == "bfloat16"
    assert dtype(sglang_server("model", dtype="float32", log_dir=str(tmp_path))) == "float32"
    with pytest.raises(ValueError, match=r"--dtype: megarl sets these itself"):
        sglang_server("model", extra_args=("--dtype", "float16"), log_dir=str(tmp_path))


def test_decode_graphs_cover_each_servers_share_of_the_batch(monkeypatch, tmp_path):
    def graph_rows(server):
        flag = "--cuda-graph-max-bs-decode"
        return server.command[server.command.index(flag) + 1] if flag in server.command else None

    def server(**kwargs):
        return sglang_server("model", log_dir=str(tmp_path), **kwargs)
    assert graph_rows(server(decode_rows=256)) is None  # SGLang's own limit covers it
    assert graph_rows(server(decode_rows=512)) == "512"
    assert graph_rows(server(decode_rows=5000)) == "1024"
    eager = server(decode_rows=512, cuda_graph=False)
    assert graph_rows(eager) is None and "--disable-cuda-graph" in eager.command
    assert server(decode_rows=512, extra_args=("--cuda-graph-max-bs-decode", 64)).command[-1] == "64"  # user's last
    shares = []

    def launch_fake(model_path, decode_rows, **kwargs):
        shares.append(decode_rows)
        return fake_server(tmp_path)
    monkeypatch.setattr(sglang_module, "sglang_server", launch_fake)
    SGLangRolloutEngine("unused", num_servers=3, colocated=False, batch_rows=1000).shutdown()
    assert shares == [352] * 3  # 334 rows each, rounded up to 32: prompt groups split unevenly


def test_server_does_not_inherit_its_launchers_process_group(monkeypatch, tmp_path):
    # under torchrun a TP=2 server inheriting TORCHELASTIC_USE_AGENT_STORE never starts (GPU, session 6)
    for key, value in dict(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0", RANK="1",
                           LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500",
                           CUDA_VISIBLE_DEVICES="0,1", MEGARL_KEPT="yes").items():
        monkeypatch.setenv(key, value)
    env = sglang_server("model", tp=2, visible_devices=["2", "3"], log_dir=str(tmp_path)).server_env()
    assert not {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT"} & env.keys()
    assert env["MEGARL_KEPT"] == "yes" and env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["PATH"] == os.environ["PATH"]


def test_flat_layout_pack_unpack_roundtrip():
    bucket = bucket_of(7)
    layout, size = flat_bucket.flat_layout(bucket)
    assert size == 24 * 2 + 4 * 4 + 9 * 2 and layout[1][3:] == [48, 64]
    flat = flat_bucket.pack(bucket, torch.empty(size + 10, dtype=torch.uint8))
    assert flat.numel() == size
    for (name, t), (name2, v) in zip(bucket, flat_bucket.unpack(flat, layout)):
        assert name == name2 and tensor_digest(t) == tensor_digest(v)
    with pytest.raises(ValueError, match="weight format 'nope'"):
        cuda_ipc.CudaIpcSender([], "nope", serializer=cuda_ipc.plain_serializer)


# Module prefixes sglang 0.5.17's SafeUnpickler (sglang/srt/utils/common.py) loads classes from (those a payload
# may touch); it refuses any other class, so a payload class of megarl's own crashes the server's TP worker.
SGLANG_UNPICKLER_PREFIXES = ("builtins.", "collections.", "copyreg.", "functools.", "torch.", "sglang.srt.")


class SGLangUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if not (module + ".").startswith(SGLANG_UNPICKLER_PREFIXES):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


def test_persistent_payload_passes_sglangs_safe_unpickler():
    """SGLang unpickles every payload with its safe unpickler: a payload class outside its allowlist (an earlier
    payload wrapped the buffer in one of megarl's) kills the server's TP worker on the first post."""
    class Model:
        def load_weights(self, named):
            self.weights = {n: t.clone() for n, t in named}

    bucket = bucket_of(3)
    sender = cuda_ipc.CudaIpcSender([], "persistent", serializer=lambda obj: obj)  # the objects themselves
    _, payload, _ = sender.payload(bucket, None)
    named = SGLangUnpickler(io.BytesIO(pickle.dumps(payload(None, 0)))).load()
    model = Model()
    sglang_loader.load_flat_bucket(model, named)
    assert {n: tensor_digest(t) for n, t in model.weights.items()} == {n: tensor_digest(t) for n, t in bucket}
    with pytest.raises(RuntimeError, match="Blocked unsafe class loading"):  # what a class of megarl's own meets
        SGLangUnpickler(io.BytesIO(pickle.dumps(SamplingParams()))).load()
