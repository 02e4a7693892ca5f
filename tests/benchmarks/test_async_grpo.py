"""benchmarks/async_grpo.py's own logic on the CPU: every run's overrides make a valid config of its mode, and the
numbers (wall-clock tokens/s/GPU, GPU busy fraction, staleness histogram, overlap bound, timeline) come out of a
metrics file as computed by hand."""

import json

import pytest

from benchmarks.async_grpo import (RUNS, long_tail_stops, main, parse_args, parse_smi, run_overrides, summarize_run,
                                   table)
from benchmarks.plot_timeline import nested, spans_of
from megarl.config import load_config


def test_every_run_is_a_valid_config_of_its_mode_and_placement(tmp_path):
    for suite in ("colocated", "disaggregated"):
        args = parse_args(["--out-dir", str(tmp_path), "--placement", suite, "--gpus",
                           "4" if suite == "disaggregated" else "1"])
        for name in args.runs:
            placement, overrides = RUNS[name]
            cmd = run_overrides(args, name, tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "v.jsonl",
                                tmp_path / name, "cuda")
            cfg = load_config(None, cmd[3:])
            assert cfg.trainer.mode == overrides["trainer.mode"] and cfg.rollout.engine == "sglang"
            # warm-up, measured, and one whose metrics wait for the evaluation; an async run leaves out its buffer's
            # first fill and the steps after its last batch is made, max_staleness + 1 each
            margin = 1 if cfg.trainer.mode == "sync" else cfg.async_.max_staleness + 1
            assert cfg.trainer.steps == (max(1, margin) if cfg.trainer.mode != "sync" else 1) + 3 + margin
            assert cfg.rollout.ignore_eos and cfg.rollout.n_samples == 8 and cfg.data.prompts_per_step == \
                (32 if suite == "colocated" else 64)
            assert cfg.rollout.max_new_tokens == (512 if suite == "colocated" else 1024)
            disaggregated = placement == "disaggregated"
            assert (cfg.actor.parallel.world_size, cfg.rollout.sglang_gpus) == ((2, 2) if disaggregated else
                                                                                (args.gpus, 0))
            if name in ("sync_offload", "sync_resident"):
                assert cfg.trainer.offload_between_phases == ("always" if name == "sync_offload" else "never")
            if cfg.trainer.mode == "async":  # async_s<max_staleness>[_k<batches_at_once>]
                staleness, _, at_once = name.split("async_s")[1].partition("_k")
                assert (cfg.async_.max_staleness, cfg.async_.batches_at_once, cfg.async_.partial) == \
                    (int(staleness), int(at_once or 1), "resume")
            assert cfg.actor.max_tokens_per_micro_batch == 0  # megarl's automatic width
    # the long tail: natural lengths to 4096, micro-batches as wide in tokens as the fixed workload's (16 rows of 4224
    # tokens ran a 1.5B update out of memory on an H200)
    tail = parse_args(["--out-dir", str(tmp_path), "--placement=disaggregated", "--lengths", "tail", "--gpus", "4"])
    cfg = load_config(None, run_overrides(tail, "disagg_sync", tmp_path / "m", tmp_path / "p.jsonl",
                                          tmp_path / "v.jsonl", tmp_path / "r", "cuda")[3:])
    assert (cfg.rollout.max_new_tokens, cfg.rollout.ignore_eos, cfg.actor.max_tokens_per_micro_batch) == \
        (4096, False, 16 * (128 + 1024))
    with pytest.raises(SystemExit):
        parse_args(["--out-dir", str(tmp_path), "--runs", "sync,async"])
    with pytest.raises(SystemExit):  # disaggregated on one GPU
        parse_args(["--out-dir", str(tmp_path), "--runs", "disagg_sync"])


def test_long_tail_stops_make_about_the_share_run_to_the_cap(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1024, "eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    k = long_tail_stops(tmp_path, cap=8, share=0.1)
    stops = json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"]
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == stops
    assert len(set(stops)) == k == 256 and stops[0] == 1 and 0 not in stops and max(stops) < 1024
    assert abs((1 - k / 1024) ** 8 - 0.1) < 0.005  # uniform samples: the share that reaches the cap


def test_numbers_of_a_synchronous_and_an_asynchronous_run():
    # synchronous: 1 warm-up step, 2 measured, 1 more; the steps' metrics appeared at t = 100, 110, 118, 130
    sync = [{"step": s, "timing/step": 8.0, "timing/generate": 5.0, "timing/reward": 1.0, "timing/train": 2.0,
             "train/response_length": 32.0} for s in (1, 2, 3, 4)]
    gpu = [(t, 50.0 if t <= 110 else 80.0) for t in range(95, 131)]
    out = summarize_run(sync, {1: 100.0, 2: 110.0, 3: 118.0, 4: 130.0}, gpu, warmup=1, steps=2, completions=4,
                        prompt_len=16, gpus=1, synchronous=True)
    assert out["measured_steps"] == 2 and out["measured_s"] == 18.0 and out["wall_step_s"] == 9.0
    assert out["tokens_per_s_per_gpu"] == round(4 * (16 + 32) * 2 / 18.0, 1)
    assert out["gpu_busy"] == round((50 * 11 + 80 * 8) / 19 / 100, 3)  # the samples at 100..118 s
    assert (out["t_gen_s"], out["t_train_s"], out["overlap_bound"]) == (6.0, 2.0, round(8 / 6, 3))
    steps = sorted({s["step"] for s in out["timeline"]})
    assert steps == [2, 3] and [(s["phase"], s["start"], s["end"]) for s in out["timeline"][:3]] == \
        [("generate", 0.0, 5.0), ("reward", 5.0, 6.0), ("train", 6.0, 8.0)]  # step 2 laid back from t = 110
    assert out["timeline"][3]["start"] == 8.0  # step 3 starts at 118 - 8 = 110

    # asynchronous: the trainer's phase marks, staleness counts per step
    rows = [{"step": s, "timing/step": 3.0, "timing/rollout": 4.0, "timing/generate": 3.5, "timing/train": 2.0,
             "phase/rollout/start": 3.0 * s - 1, "phase/rollout/end": 3.0 * s + 3,
             "phase/generate/start": 3.0 * s - 1, "phase/generate/end": 3.0 * s + 2.5,
             "phase/train/start": 3.0 * s, "phase/train/end": 3.0 * s + 2, "async/staleness_0": 2, "async/staleness_1": s,
             "perf/tokens_per_s_per_gpu": 50.0, "async/batches_at_once": s} for s in (1, 2, 3)]
    out = summarize_run(rows, {1: 10.0, 2: 13.0, 3: 16.0}, [], warmup=1, steps=2, completions=4, prompt_len=16,
                        gpus=1, synchronous=False)
    assert out["staleness_histogram"] == {"0": 4, "1": 5} and out["trainer_tokens_per_s_per_gpu"] == 50.0
    assert out["batches_per_call"] == 2.5 and "0:4 1:5 (batches/call 2.5) |" in table({"async": out})
    assert "overlap_bound" not in out and "gpu_busy" not in out
    lanes = {(s["phase"], s["lane"]) for s in out["timeline"]}
    assert lanes == {("generate", "rollout"), ("train", "trainer")}  # the rollout container left out
    assert min(s["start"] for s in out["timeline"]) == 0.0
    assert [(s["phase"], s["start"]) for s in spans_of({"timeline": out["timeline"]}, steps=1)] == \
        [("generate", 0.0), ("train", 1.0)]


def test_a_phase_within_another_of_its_lane_is_drawn_nested():
    # the async rollout's reward span (first group scored to last) lies within generate: drawn thin on top of it
    spans = [{"phase": "generate", "lane": "rollout", "step": 1, "start": 0.0, "end": 28.0},
             {"phase": "reward", "lane": "rollout", "step": 1, "start": 9.0, "end": 27.5},
             {"phase": "train", "lane": "trainer", "step": 1, "start": 10.0, "end": 20.0},
             {"phase": "generate", "lane": "rollout", "step": 2, "start": 28.0, "end": 50.0}]
    assert [nested(s, spans) for s in spans] == [False, True, False, False]


def test_smi_samples_and_the_merged_report(tmp_path, capsys):
    assert parse_smi("2026/11/24 07:25:00.250, 1, 87\n")[1] == 87.0
    assert parse_smi("2026/11/24 07:25:00.250, 0, 87")[0] % 1 == 0.25
    assert parse_smi("[Not Supported]") is None
    for name, tps in (("sync_resident", 100.0), ("async_s1", 150.0)):
        record = {"name": name, "status": "ok", "tokens_per_s_per_gpu": tps, "synchronous": name.startswith("sync")}
        (tmp_path / f"{name}.json").write_text(json.dumps({"runs": {name: record | {"overlap_bound": 1.6}}}))
    assert main(["--report", str(tmp_path / "sync_resident.json"), str(tmp_path / "async_s1.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("| async_s1 | ok |") and "| 1.50x (sync_resident) | 1.60x |" in lines[-1]
    assert "| 1.00x (sync_resident) |" in lines[-2]
    assert table({}).count("\n") == 1
