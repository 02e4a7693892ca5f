"""The timeline plot of a few steps for docs/benchmarks.md, from benchmarks/async_grpo.py's JSON (or
benchmarks/async_disagg.py's): one panel per run, two lanes (rollout: generation and reward; trainer: log-probs,
update, weight sync, memory moves), a bar per phase of each measured step, so what overlaps with what shows.
Needs matplotlib (not a megarl dependency: `pip install matplotlib`).

    python benchmarks/plot_timeline.py async_grpo.json timeline.png [--steps 3] [--runs sync_resident,async_s1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LANES = ("rollout", "trainer")


def spans_of(run: dict, steps: int) -> list[dict]:
    """The run's timeline spans of its first `steps` measured steps, from the earliest of them."""
    timeline = run.get("timeline", [])
    kept = sorted({s["step"] for s in timeline})[:steps]
    spans = [s for s in timeline if s["step"] in kept]
    origin = min((s["start"] for s in spans), default=0.0)
    return [s | {"start": s["start"] - origin, "end": s["end"] - origin} for s in spans]


def nested(span: dict, spans: list[dict]) -> bool:
    """Whether `span` lies within a longer span of its lane and step: the async rollout's reward span, which runs
    from the first group's scoring to the last's while generation goes on (its time is the phase table's), is drawn
    thin on top of generate rather than as if it had the lane to itself."""
    return any(o is not span and o["lane"] == span["lane"] and o["step"] == span["step"]
               and o["start"] <= span["start"] and span["end"] <= o["end"]
               and o["end"] - o["start"] > span["end"] - span["start"] for o in spans)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="async_grpo.json files (runs of several calls are merged) and, last, "
                                              "the PNG to write")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run to draw")
    p.add_argument("--runs", default="", help="comma-separated runs to draw (default: every run with a timeline)")
    args = p.parse_args(argv)
    *inputs, png = args.results
    if not inputs:
        p.error("give at least one results JSON and the PNG path")
    runs = {}
    for path in inputs:
        runs |= json.loads(Path(path).read_text())["runs"]
    wanted = [r for r in args.runs.split(",") if r] or list(runs)
    panels = {name: spans_of(runs[name], args.steps) for name in wanted if name in runs}
    panels = {name: spans for name, spans in panels.items() if spans}
    if not panels:
        print(f"{', '.join(inputs)}: no run has a timeline; nothing to plot")
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(dict.fromkeys(s["phase"] for spans in panels.values() for s in spans))
    colors = dict(zip(phases, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    right = max(s["end"] for spans in panels.values() for s in spans)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.3 + 1.1 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, spans) in zip(axes[:, 0], panels.items()):
        for s in sorted(spans, key=lambda s: s["start"] - s["end"]):  # longest first, so a nested span lies on top
            lane = LANES.index(s["lane"])
            ax.barh(lane, s["end"] - s["start"], left=s["start"], height=0.3 if nested(s, spans) else 0.7,
                    color=colors[s["phase"]], edgecolor="white", linewidth=0.5)
        for step in sorted({s["step"] for s in spans}):  # where each step's trainer side ends
            end = max((s["end"] for s in spans if s["step"] == step and s["lane"] == "trainer"), default=None)
            if end is not None:
                ax.axvline(end, color="grey", linewidth=0.6, linestyle=":")
        ax.set_yticks(range(len(LANES)), LANES)
        ax.set_ylim(-0.6, len(LANES) - 0.4)
        ax.set_xlim(0, right)
        ax.set_title(name, loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("seconds (dotted: a step's training side ends; thin: a phase within the one beneath, "
                           "from its first interval to its last)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    fig.legend(handles, phases, loc="upper center", ncol=min(len(phases), 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (1.3 + 1.1 * len(panels))))
    fig.savefig(png, dpi=130)
    print(f"wrote {png}: {', '.join(panels)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
