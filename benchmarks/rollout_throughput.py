"""The `throughput` part of benchmarks/weight_sync.py (run it through that script: `python benchmarks/weight_sync.py
throughput ...`; its docstring says what is measured): megarl's rollout path against sglang.Engine in-process.
"""

from __future__ import annotations

import shutil
import time

import torch

from benchmarks.weight_sync import SPLIT_ROWS, _write, model_dir_for

# SGLangRolloutEngine with one request per call, in concurrent requests of SPLIT_ROWS, and on a server with SGLang's
# memory saver (as colocated).
PATHS = ("sglang_engine", "megarl", "megarl_split", "megarl_memory_saver")


def part_throughput(args) -> dict:
    """The same kind of requests through sglang.Engine in-process and megarl's engine, all alive on one GPU at
    once and measured in turns (round r runs every path, each on a batch of its own: no prefix cache hits across
    paths; the order rotates every round), so that a change of the machine's speed during the part (CPU
    contention: decode past SGLang's captured batch sizes is CPU-bound) falls on every path alike. Each path's
    tok/s is its median over --rounds rounds after a warm-up batch; ratios are against sglang.Engine's median."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.rollout.sglang_server import decode_graph_rows

    name, n, new = args.models[0], args.n, args.new_tokens
    # decode CUDA graphs as megarl's servers size them for a batch (batch_rows), given to sglang.Engine too: past
    # SGLang's default 256 rows a batch decodes eagerly, CPU-bound, 4x slower and as noisy as the host
    graph_rows = decode_graph_rows(args.prompts * n)
    result = dict(model=name, prompts=args.prompts, prompt_len=args.prompt_len, n=n, new_tokens=new,
                  rounds=args.rounds, mem_fraction=args.throughput_mem_fraction,
                  decode_graph_rows=graph_rows)
    if args.dry_run:
        result |= {f"{p}_tok_s": 0.0 for p in PATHS} | dict(dry_run=True, ratio=0.0, ratio_split=0.0,
                                                              ratio_memory_saver=0.0, ratio_inside=0.0,
                                                              ratio_paired=0.0)
        _write(args, result)
        return result
    g = torch.Generator().manual_seed(0)
    # a batch per path per round, and one for request_split
    batches = [torch.randint(100, 10000, (args.prompts, args.prompt_len), generator=g).tolist()
               for _ in range((args.rounds + 1) * len(PATHS) + 1)]
    fresh = iter(batches[:-1])
    sampling = {"max_new_tokens": new, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    model_dir = model_dir_for(name)
    import sglang

    # ignore_eos on every path: the dummy model's EOS would end rows at random
    llm = sglang.Engine(model_path=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                        attention_backend="triton", sampling_backend="pytorch",
                        mem_fraction_static=args.throughput_mem_fraction,
                        cuda_graph_max_bs_decode=graph_rows)
    servers = []
    try:
        for memory_saver in (False, True):
            servers.append(SGLangRolloutEngine(
                str(model_dir), colocated=False, load_format="dummy", mem_fraction=args.throughput_mem_fraction,
                memory_saver=memory_saver, log_dir=args.log_dir, sampling_overrides={"ignore_eos": True},
                startup_timeout=args.startup_timeout,
                batch_rows=args.prompts * n))
        megarl, saver = servers
        params = SamplingParams(max_new_tokens=new, n=n, temperature=1.0)

        served: list[float] = []  # SGLang's own time for each answer of a call: its slowest row's e2e_latency

        def engine_tokens(batch):
            rows = [p for p in batch for _ in range(n)]
            outs = llm.generate(input_ids=rows, return_logprob=True, sampling_params=sampling)
            served.append(max(o["meta_info"]["e2e_latency"] for o in outs))
            return sum(len(o["meta_info"]["output_token_logprobs"]) for o in outs)

        def time_answers(server):  # megarl's engine keeps no meta_info: read it off the answers on their way
            post = server.post

            def timed(route, payload=None, timeout=None, convert=None):
                def read(body):
                    if route == "/generate":
                        served.append(max(o["meta_info"]["e2e_latency"] for o in body))
                    return convert(body) if convert else body
                return post(route, payload, timeout, convert=read)
            server.post = timed

        for server in megarl.servers + saver.servers:
            time_answers(server)

        def megarl_tokens(engine, rows_per_request):
            def run(batch):
                engine.rows_per_request = rows_per_request
                return sum(len(x.token_ids) for x in engine.generate(batch, params))
            return run

        def flush_servers(engine):
            def flush():
                for server in engine.servers:
                    server.post("/flush_cache")
            return flush

        # every batch starts from an empty prefix cache, as after a weight sync in training; otherwise the server
        # that two paths share fills its cache first and pays for evictions in the later rounds
        flushes = dict(sglang_engine=llm.flush_cache, megarl=flush_servers(megarl), megarl_split=flush_servers(megarl),
                       megarl_memory_saver=flush_servers(saver))
        runs = dict(sglang_engine=engine_tokens, megarl=megarl_tokens(megarl, 0),
                    megarl_split=megarl_tokens(megarl, SPLIT_ROWS), megarl_memory_saver=megarl_tokens(saver, 0))
        rates, inside_rates = {p: [] for p in PATHS}, {p: [] for p in PATHS}
        for round_ in range(args.rounds + 1):  # round 0 warms every path up
            for path in PATHS[round_ % len(PATHS):] + PATHS[:round_ % len(PATHS)]:
                flushes[path]()
                served.clear()
                start = time.perf_counter()
                tokens = runs[path](next(fresh))
                if round_:
                    rates[path].append(tokens / (time.perf_counter() - start))
                    inside_rates[path].append(tokens / max(served))
            if round_:
                median = {p: sorted(r)[len(r) // 2] for p, r in rates.items()}
                inside = {p: sorted(r)[len(r) // 2] for p, r in inside_rates.items()}
                result |= {f"{p}_tok_s": median[p] for p in PATHS} | dict(rates=rates, inside_rates=inside_rates)
                result |= {key: median[p] / median["sglang_engine"] for key, p in
                           (("ratio", "megarl"), ("ratio_split", "megarl_split"),
                            ("ratio_memory_saver", "megarl_memory_saver"))}
                # the same ratio on SGLang's own clock: below `ratio` means time lost outside SGLang (HTTP, JSON,
                # megarl's conversion); equal means the servers themselves decode slower than the Engine
                result["ratio_inside"] = inside["megarl"] / inside["sglang_engine"]
                # each round's megarl rate over the Engine's in that round: a slow spell of the machine, which
                # the ratio of medians keeps when it falls on one path's rounds more than another's, cancels
                paired = sorted(m / e for m, e in zip(rates["megarl"], rates["sglang_engine"]))
                result["ratio_paired"] = paired[len(paired) // 2]
                _write(args, result)
        result |= request_split(llm, megarl, batches[-1], n, sampling)
        _write(args, result)
    finally:
        for server in servers:
            server.shutdown()
        llm.shutdown()
        shutil.rmtree(model_dir, ignore_errors=True)
    return result


def request_split(llm, engine, batch: list[list[int]], n: int, sampling: dict) -> dict:
    """Where megarl's rollout time goes: the same rows in one /generate, sent as Endpoint.post and converted as
    SGLangRolloutEngine.generate does, each step timed (encode, answered, parse, convert), and the time SGLang's
    tokenizer manager saw it (the longest e2e_latency): "answered" beyond that is the server's JSON and HTTP.
    The same for sglang.Engine (its wall time beyond the inside: the in-process hand-over)."""
    import requests

    from megarl.rollout.sglang import _to_generation
    from megarl.rollout.sglang_server import gc_paused, json_dumps, json_loads

    rows = [p for p in batch for _ in range(n)]
    llm.flush_cache()
    start = time.perf_counter()
    outs = llm.generate(input_ids=rows, return_logprob=True, sampling_params=sampling)
    split = dict(sglang_engine_wall_s=time.perf_counter() - start,
                 sglang_engine_inside_s=max(o["meta_info"]["e2e_latency"] for o in outs))
    request = {"input_ids": rows, "sampling_params": sampling | {"stop_token_ids": []}, "return_logprob": True}
    server = engine.servers[0]
    server.post("/flush_cache")
    start = time.perf_counter()  # Endpoint.post's steps, each timed
    body = json_dumps(request)
    encoded = time.perf_counter()
    response = requests.post(server.url + "/generate", data=body, headers={"Content-Type": "application/json"})
    received = time.perf_counter()
    with gc_paused():
        outs = json_loads(response.content)
        parsed = time.perf_counter()
        [_to_generation(0, out) for out in outs]
    return split | dict(megarl_request_wall_s=time.perf_counter() - start,
                        megarl_request_inside_s=max(o["meta_info"]["e2e_latency"] for o in outs),
                        megarl_request_encode_s=encoded - start, megarl_request_answered_s=received - encoded,
                        megarl_request_parse_s=parsed - received, megarl_request_convert_s=time.perf_counter() - parsed,
                        megarl_answer_mb=len(response.content) / 1e6)
