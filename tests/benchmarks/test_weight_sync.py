"""benchmarks/weight_sync.py's own logic on the CPU: argument checks, the measuring order (7B first), the
bytes a sync moves, the JSON written per measurement, the per-call timing of the engine's posts, the table."""

import json

import pytest

from benchmarks.weight_sync import main, parse_args, server_loads, table, time_posts


def test_defaults_measure_7b_first_and_bad_input_names_the_option(capsys):
    args = parse_args(["sync"])
    assert args.models[0] == "qwen2.5-7b" and args.formats == ["persistent", "flattened_bucket", "tensors"]
    for argv, message in ((["sync", "--models", "qwen9-1t"], "--models qwen9-1t"),
                          (["sync", "--formats", "json"], "invalid choice: 'json'"),
                          (["sync", "--bucket-mb", "0"], "--bucket-mb and --trials must be >= 1"),
                          (["table"], "table needs --out-dir")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_dry_run_writes_every_measurement_in_order_with_the_checkpoint_bytes(tmp_path):
    out = tmp_path / "sync_7b.json"
    main(["sync", "--models", "qwen2.5-7b", "qwen2.5-0.5b", "--formats", "persistent", "tensors", "--bucket-mb", "1024",
          "2048", "--verify", "--dry-run", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["model"], r["bucket_mb"], r["format"]) for r in rows] == [
        (m, b, f) for m in ("qwen2.5-7b", "qwen2.5-0.5b") for b in (1024, 2048) for f in ("persistent", "tensors")]
    # bf16 bytes of the HF tensors (Qwen2.5-0.5B: 494,032,768 parameters, the tied embedding counted once)
    assert rows[-1]["bytes"] == 2 * 494_032_768 and rows[0]["bytes"] == 15_231_233_024
    assert all(r["dry_run"] and r["verified"] == "planned" for r in rows)


def test_posts_are_timed_by_path_and_memory_tags():
    class Server:
        def post(self, path, payload=None, timeout=None):
            return (path, payload, timeout)

    server, seconds = Server(), {}
    time_posts(server, seconds)
    assert server.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}, 3) == \
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}, 3)
    server.post("/flush_cache")
    server.post("/flush_cache")
    assert set(seconds) == {"/resume_memory_occupation kv_cache cuda_graph", "/flush_cache"}
    assert all(s >= 0 for s in seconds.values())


def test_table_lists_parts_in_order_with_errors_and_missing_parts(tmp_path):
    row = dict(model="qwen2.5-7b", format="persistent", server_tp=1, bucket_mb=1024, bytes=15_231_233_024, total_s=0.15,
               resume_s=0.02, convert_s=0.05, pack_s=0.03, transfer_s=0.03, ready_s=0.012, kv_s=0.011, flush_s=0.0,
               posts=15, posts_s=0.141, server_load_s=0.052, gb_per_s=101.5)
    error = dict(model="qwen2.5-7b", format="tensors", server_tp=1, bucket_mb=1024, error="SGLangError('hung')")
    (tmp_path / "sync_7b.json").write_text(json.dumps(dict(gpu="NVIDIA H200", results=[row, error])))
    (tmp_path / "throughput.json").write_text(json.dumps(dict(gpu="NVIDIA H200", results=dict(
        model="qwen2.5-0.5b", prompts=128, n=4, new_tokens=256, rounds=3, megarl_tok_s=20000.4, sglang_engine_tok_s=25000.0,
        ratio=0.8, megarl_memory_saver_tok_s=17500.0, ratio_memory_saver=0.7, sglang_engine_wall_s=4.0,
        sglang_engine_inside_s=3.95, megarl_request_wall_s=4.9, megarl_request_inside_s=4.2,
        megarl_request_encode_s=0.001, megarl_request_answered_s=4.3, megarl_request_parse_s=0.05,
        megarl_answer_mb=5.83, megarl_request_convert_s=0.01,
        megarl_split_tok_s=24000.0, ratio_split=0.96, ratio_inside=0.97, ratio_paired=0.9))))
    lines = table(tmp_path, ["sync_7b", "sync_1.5b", "throughput"]).splitlines()
    assert lines[2] == ("| sync_7b | qwen2.5-7b | persistent | 1 | 1024 | 15.23 | 0.150 | 0.020 | 0.050 | 0.030 | 0.030 "
                        "| 0.012 (0.011 + 0.000) | 15, 0.141 (0.052) | 101.5 |  |")
    assert lines[3] == "| sync_7b | qwen2.5-7b | tensors | 1 | 1024 | ERROR SGLangError('hung') |"
    assert lines[4] == "| sync_1.5b | no results (skipped, or failed: see sync_1.5b.log) |"
    assert lines[5] == ("rollout tok/s (qwen2.5-0.5b, 128 prompts x n=4 x 256 new, median of 3 rounds): megarl 20000, sglang.Engine 25000, "
                        "ratio 0.800; megarl with SGLang's memory saver (as colocated) 17500, ratio 0.700; "
                        "megarl in requests of 64 rows 24000, ratio 0.960; on SGLang's own clock, ratio 0.970; "
                        "median of the rounds' ratios 0.900")
    assert lines[6] == ("one batch, wall s (inside SGLang's tokenizer manager): sglang.Engine 4.000 (3.950), "
                        "megarl's raw /generate 4.900 (4.200)")
    assert lines[7] == "megarl's request, s: encode 0.001, answered 4.300, parse 0.050 (5.8 MB), convert 0.010"


def test_server_loads_sum_each_rank_and_report_the_slowest_since_the_last_call(tmp_path):
    class Server:
        log_path = tmp_path / "server.log"

    server = Server()
    line = "[2026-11-22 TP{0}] megarl weight load: rank {0} bytes 1024 queued {1} seconds {2}\n"
    server.log_path.write_text("start-up\n" + line.format(0, 0.001, 0.002) + line.format(1, 0.001, 0.004))
    assert server_loads(server) == {"server_load_s": 0.004, "server_queued_s": 0.001}
    with open(server.log_path, "a") as log:
        log.write(line.format(0, 0.002, 0.003) + line.format(0, 0.003, 0.005) + line.format(1, 0.001, 0.006))
    assert server_loads(server) == pytest.approx({"server_load_s": 0.008, "server_queued_s": 0.005})
    assert server_loads(server) == {"server_load_s": 0.0, "server_queued_s": 0.0}  # nothing new
