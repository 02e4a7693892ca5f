"""scripts/chaos.py's own machinery, without a run (a restart of each kind is tests/test_recovery.py's and
tests/test_async_recovery.py's): a seed draws the same faults, all after the first checkpoint, and the markdown it
writes says the command, date and commit and reads back as tables (as tests/test_doc_figures.py reads results)."""

import argparse
import importlib.util
import random

from tests.test_doc_figures import ROOT, _table_rows


def chaos_module():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_seed_draws_the_same_faults_after_the_first_checkpoint_and_the_report_reads_back():
    chaos = chaos_module()
    args = argparse.Namespace(steps=60, save_every=5, faults=8, kinds=["kill", "stop"], max_delay_s=6.0,
                              worker_timeout_s=60.0)
    first, again = (chaos.draw_plan(random.Random(3), args) for _ in range(2))
    assert first == again and first != chaos.draw_plan(random.Random(4), args)
    steps = [f["step"] for f in first]
    assert steps == sorted(set(steps)) and len(steps) == 8 and min(steps) > 5 and max(steps) <= 60
    assert {f["kind"] for f in first} <= {"kill", "stop"} and {f["target"] for f in first} <= {0, 1, "rollout"}
    assert all(0 <= f["delay_s"] <= 6.0 for f in first)

    restart = {"cause": "the rollout actor missed its deadline in generate during step 12", "resumed_from": 10,
               "replayed_steps": 1, "lost_s": 61.04, "recovery_s": 20.5, "seconds_lost": 81.54}
    faults = [{"round": 1, "step": 11, "fired_step": 12, "kind": "stop", "target": "rollout", "delay_s": 2.5,
               "restart": restart},
              {"round": 1, "step": 59, "fired_step": None, "kind": "kill", "target": 1, "delay_s": 5.0,
               "restart": None}]
    rounds = [{"round": 1, "planned": 2, "fired": 1, "restarts": 1, "completed": True, "stopped": None,
               "wall_s": 130.0, "metrics_equal": True, "differing": [], "weights_equal": True}]
    text = chaos.report(args, ["--steps", "60", "--out", "x.md"], 40.0, rounds, faults)
    head = text.splitlines()[:4]
    assert head[2].startswith("Command: `python scripts/chaos.py --steps 60 --out x.md`")
    assert head[3].startswith("Date: ") and "; commit " in head[3]
    fault_rows, round_rows = [r for r in _table_rows(text) if "fault" in r], [r for r in _table_rows(text)
                                                                               if "faults sent" in r]
    assert [(r["kind"], r["target"], r["fired in step"], r["seconds lost"]) for r in fault_rows] == [
        ("SIGSTOP", "rollout actor", "12", "81.5"), ("SIGKILL", "actor rank 1", "-", "-")]
    assert fault_rows[0]["restart cause"] == restart["cause"]
    assert fault_rows[1]["restart cause"] == "never sent (the run ended first)"
    assert round_rows == [{"round": "1", "faults planned": "2", "faults sent": "1", "restarts": "1",
                           "completed": "True", "wall s": "130.0", "extra wall s": "90.0", "metrics equal": "True",
                           "weights equal": "True"}]
