"""scripts/gpu/multi_gpu.sh's CPU smoke mode, as the lead's GPU call runs it: a tiny DeepSeek-V3 trained by GRPO at
TP=1 x EP=2 x PP=2 on four gloo ranks (each holding half the routed experts of its stage), synced into two generation
engines of TP=2 (the transformers engine in SGLang's place) by sharded delivery: each generation rank gets its TP rows
of every tensor, expert rows pulled by the resharder from the EP rank owning them. Every sync is verified by
checksums, and its bytes per rank (received and sent resharding, received by each generation rank) equal the
planner's for the same layouts; the script's table says so. The async phase's lanes run side by side."""

import json
import os
import subprocess

from tests.launch.launch_utils import ROOT


def test_ep_pp_phase_smoke_trains_uneven_stages_and_moves_the_planned_bytes(tmp_path):
    """The DeepSeek-V3-shaped runs' four-GPU layout: TP=1 x EP=2 x PP=2, the last stage one decoder layer of three,
    into two generation engines of TP=2 by sharded delivery; every sync verified and its bytes per rank the planner's
    for that layout."""
    env = dict(os.environ, DEVICE="cpu", GPUS="4", PHASES="ep_pp", EP_DELIVERIES="sharded", OUT=str(tmp_path / "out"))
    run = subprocess.run(["bash", "scripts/gpu/multi_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "== multi_gpu.sh: exit 0" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    log = (tmp_path / "out" / "ep_pp_ep2_pp2_sharded.log").read_text()
    assert "world_size=4 = tp 1 x pp 2 x cp 1 x dp 2 (ep 2, last stage 1 layers)" in log
    records = [json.loads(line) for line in (tmp_path / "out" / "ep_pp_ep2_pp2_sharded_metrics.jsonl").read_text()
               .splitlines()]
    syncs = [r for r in records if "sync/seconds" in r]
    assert len(syncs) == 2 and all(r["sync/verified"] == 1.0 and r["sync/traffic_as_planned"] == 1.0 for r in syncs)
    for r in syncs:  # expert rows moved between the EP ranks of a stage; each engine's rank got half its layers
        assert r["sync/reshard_send_max"] == r["sync/plan_reshard_send_max"] > 0
        assert r["sync/reshard_recv_max"] == r["sync/plan_reshard_recv_max"] > 0
        assert r["sync/server_recv_max"] == r["sync/plan_server_recv_max"] > 0
        assert r["sync/server_recv_min"] == r["sync/plan_server_recv_min"]
    assert any("rollout/logprob_abs_diff" in r for r in records)
    row = next(line for line in run.stdout.splitlines() if line.startswith("| ep_pp_ep2_pp2_sharded |"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[4] == "2/2" and cells[9] == "2/2", row  # syncs verified; bytes as planned


def test_async_lanes_split_one_workloads_runs_and_merge_their_table(tmp_path):
    """LANES: the fixed workload's runs split over two GPU pairs of one call, each lane its own results; the table
    merges them, so the speed-up of the one lane's run is taken against the other lane's disaggregated sync."""
    env = dict(os.environ, DEVICE="cpu", GPUS="4", PHASES="async", LANES="fixed:disagg_sync fixed:disagg_one_step_off",
               OUT=str(tmp_path / "out"))
    run = subprocess.run(["bash", "scripts/gpu/multi_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0 and "== multi_gpu.sh: exit 0" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    lanes = {d: json.loads((tmp_path / "out" / d / "async_grpo.json").read_text())["runs"]
             for d in ("async_fixed", "async_fixed_1")}
    assert set(lanes["async_fixed"]) == {"disagg_sync_fixed"} and set(lanes["async_fixed_1"]) == \
        {"disagg_one_step_off_fixed"}
    assert "== async GRPO, disaggregated (fixed), lanes: async_fixed async_fixed_1" in run.stdout
    sync = lanes["async_fixed"]["disagg_sync_fixed"]["tokens_per_s_per_gpu"]
    off = lanes["async_fixed_1"]["disagg_one_step_off_fixed"]["tokens_per_s_per_gpu"]
    row = next(line for line in run.stdout.splitlines() if line.startswith("| disagg_one_step_off_fixed |"))
    assert f"{off / sync:.2f}x (disagg_sync_fixed)" in row, row
