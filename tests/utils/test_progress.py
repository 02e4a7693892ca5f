"""Progress: step lines with their total and ETA, one line per interval without a terminal, a tqdm bar on one."""

import re

from megarl.utils.progress import Phases, Progress
from megarl.utils.tracking import Tracker

ETA = re.compile(r" \| ETA \d\d:\d\d$")


def test_step_lines_say_step_n_of_t_and_the_eta(tmp_path, capsys):
    with Tracker(str(tmp_path), ["console"]) as tracker:
        tracker.log({"val/reward": 0.25}, 0)  # before the phase: no total
        with tracker.steps("RL", 10, done=2):  # resumed after step 2
            for step in (3, 4, 10):
                tracker.log({"train/reward": 0.5, "timing/step": 1.0}, step)
    lines = capsys.readouterr().out.splitlines()  # stdout is no terminal here: no bar, only the lines
    assert lines[0] == "step 0 | val 0.25"
    assert [line.split(" | ")[0] for line in lines[1:]] == ["step 3/10", "step 4/10", "step 10/10"]
    assert all(ETA.search(line) for line in lines[1:3]), lines
    assert lines[3] == "step 10/10 | reward 0.5 | 1s"  # the last step: nothing left


def test_thousands_of_short_steps_print_a_line_per_interval(tmp_path, capsys):
    with Tracker(str(tmp_path), ["console", "jsonl"]) as tracker:
        with tracker.steps("reward model", 3000, every_s=30.0):
            for step in range(1, 3001):
                tracker.log({"rm/loss": 0.5} | ({"val/pair_accuracy": 0.9} if step == 1500 else {}), step)
    lines = capsys.readouterr().out.splitlines()
    # the first step, the evaluation and the last (the loop takes far less than 30 s)
    assert [line.split(" | ")[0] for line in lines] == ["step 1/3000", "step 1500/3000", "step 3000/3000"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3000  # every step still logged


def test_a_phase_without_a_terminal_prints_plain_lines_per_interval(capsys):
    with Progress("SFT warm start", 4, every_s=0.0, terminal=False) as bar:
        for step in range(1, 5):
            bar.set(step)
        bar.set(2)  # never backwards
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == [f"SFT warm start: {n}/4 steps" for n in range(1, 5)]
    assert all(re.search(r"\d\d:\d\d elapsed, ETA \d\d:\d\d$", line) for line in lines[:3]), lines
    assert lines[3].endswith("elapsed")
    with Progress("quiet", 4, every_s=None, terminal=False) as bar:
        bar.set(4)
    assert capsys.readouterr().out == ""


def test_on_a_terminal_a_bar_shows_the_total_and_the_eta(capsys):
    with Progress("RL", 10, terminal=True) as bar:
        bar.set(3)
        bar.stage("generate")
    out = capsys.readouterr().out
    last = out.split("\r")[-1]  # the bar as last redrawn
    assert re.search(r"RL: +30%.*\| 3/10 \[\d\d:\d\d<\d\d:\d\d, .*generate\]", last), repr(out)


def test_an_opaque_phase_says_what_it_does_and_then_its_time(capsys):
    phases = Phases()
    for _ in range(2):
        with phases("evaluating 64 held-out prompts x 4 samples", kind="evaluation"):
            pass
    with phases("starting a local Ray cluster"):
        pass
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "evaluating 64 held-out prompts x 4 samples ..."
    assert re.fullmatch(r"evaluating 64 held-out prompts x 4 samples: done in \d\d:\d\d", lines[1])
    assert re.fullmatch(r"evaluating .* \.\.\. \(ETA \d\d:\d\d, as the last evaluation\)", lines[2])
    assert lines[4] == "starting a local Ray cluster ..."  # once in a run: no ETA
