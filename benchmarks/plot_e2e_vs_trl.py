"""The plot for docs/benchmarks.md from benchmarks/e2e_vs_trl.py's JSON: tokens/s end to end per run, and per
phase (the step's tokens over the time spent in that phase; log scale). Needs matplotlib (not a megarl
dependency: the GPU image has it; elsewhere `pip install matplotlib`).

    python benchmarks/plot_e2e_vs_trl.py e2e_vs_trl.json e2e_vs_trl.png
"""

from __future__ import annotations

import json
import sys

STEP_ORDER = ["generation", "reward", "memory to training", "log-probs", "update", "weight sync",
              "memory to rollout"]  # as a step runs them


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(open(argv[0]).read())
    runs = {name: r for name, r in report["runs"].items() if r.get("tokens_per_s")}
    if not runs:
        print(f"{argv[0]}: no run has measured steps; nothing to plot")
        return 1
    # a phase under a millisecond is a timer around nothing (e.g. the memory cycle when offload is off): no bar
    rates = {name: {p: r["tokens_per_step"] / s for p, s in r.get("phase_s", {}).items() if s >= 1e-3}
             for name, r in runs.items()}
    seen = dict.fromkeys(p for r in rates.values() for p in r)
    phases = [p for p in STEP_ORDER if p in seen] + [p for p in seen if p not in STEP_ORDER + ["other"]] + \
        (["other"] if "other" in seen else [])
    fig, (total, per_phase) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 2.6]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    names = list(runs)
    labels = [f"{n}\n({runs[n]['completions']}/step)" for n in names]
    bars = total.bar(labels, [runs[n]["tokens_per_s"] for n in names], color=colors[:len(names)])
    trl = runs.get("trl", {}).get("tokens_per_s")
    for bar, n in zip(bars, names):
        note = f"{runs[n]['tokens_per_s']:,.0f}" + (f"\n{runs[n]['tokens_per_s'] / trl:.1f}x TRL" if trl and n != "trl" else "")
        total.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    total.set_ylabel("tokens/s (prompt + completion), end to end")
    total.set_title("Whole step")
    total.margins(y=0.2)

    width = 0.8 / len(names)
    for i, n in enumerate(names):
        values = [rates[n].get(p, 0) for p in phases]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(phases))]
        per_phase.bar(xs, values, width, label=labels[i].replace("\n", " "), color=colors[i])
    per_phase.set_xticks(range(len(phases)), phases)
    per_phase.set_yscale("log")
    per_phase.set_ylabel("tokens per step / phase seconds")
    per_phase.set_title("Per phase (higher is faster; a missing bar: the side has no such phase)")
    per_phase.legend(fontsize=8)
    setup = report["setup"]
    fig.suptitle(f"GRPO end to end on {report['gpu'].split(',')[0]}: {setup['model']} random init, "
                 f"{setup['prompt_len']} + {setup['completion_len']} tokens, {setup['n_samples']} per prompt "
                 f"(commit {report['commit'][:7]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
