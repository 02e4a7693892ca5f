"""The plot for docs/benchmarks.md from the JSON of benchmarks/e2e_vs_trl.py or benchmarks/e2e_vs_verl.py: tokens/s
end to end per run, and per phase (the step's tokens over the time spent in that phase; log scale). Several JSONs
(e2e_vs_verl runs one side and one model size per call) go in one plot; each run is labelled with its model when
they differ, and compared with the peer (trl or verl) of the same model. Needs matplotlib (not a megarl dependency:
the GPU image has it; elsewhere `pip install matplotlib`).

    python benchmarks/plot_e2e.py OUT.png REPORT.json [REPORT.json ...]
"""

from __future__ import annotations

import json
import sys

STEP_ORDER = ["generation", "reward", "memory to training", "log-probs", "advantages", "update", "weight sync",
              "memory to rollout"]  # as a step runs them
PEERS = {"trl": "TRL", "verl": "verl"}  # run name -> how the plot names it


def collect(paths: list[str]) -> tuple[dict, dict, list[str]]:
    """{label: run} over every report's runs with measured steps (each run with its 'model' and 'completions'), the
    first report and every report's commit (for the title)."""
    reports = [json.loads(open(p).read()) for p in paths]
    models = {r["setup"]["model"] for r in reports}
    runs = {}
    for report in reports:
        setup = report["setup"]
        for name, run in report["runs"].items():
            if run.get("tokens_per_s"):
                completions = run.get("completions") or setup.get("completions")
                label = name if len(models) == 1 else f"{name} {setup['model']}"
                runs[label] = run | {"name": name, "model": setup["model"], "completions": completions}
    return runs, reports[0], list(dict.fromkeys(r["commit"][:7] for r in reports))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, first, commits = collect(argv[1:])
    if not runs:
        print(f"{' '.join(argv[1:])}: no run has measured steps; nothing to plot")
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
    labels = [f"{n.replace(' ', chr(10))}\n({runs[n]['completions']}/step)" for n in names]
    bars = total.bar(labels, [runs[n]["tokens_per_s"] for n in names], color=colors[:len(names)])
    peers = {(r["name"], r["model"]): r["tokens_per_s"] for r in runs.values() if r["name"] in PEERS}
    for bar, n in zip(bars, names):
        run = runs[n]
        peer = next(((p, peers[(p, run["model"])]) for p in PEERS if (p, run["model"]) in peers), None)
        note = f"{run['tokens_per_s']:,.0f}"
        if peer and run["name"] not in PEERS:
            note += f"\n{run['tokens_per_s'] / peer[1]:.1f}x {PEERS[peer[0]]}"
        total.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    total.tick_params(axis="x", labelsize=7)
    total.set_ylabel("tokens/s (prompt + completion), end to end")
    total.set_title("Whole step")
    total.margins(y=0.2)

    width = 0.8 / len(names)
    for i, n in enumerate(names):
        values = [rates[n].get(p, 0) for p in phases]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(phases))]
        per_phase.bar(xs, values, width, label=labels[i].replace("\n", " "), color=colors[i % len(colors)])
    per_phase.set_xticks(range(len(phases)), phases)
    per_phase.set_yscale("log")
    per_phase.set_ylabel("tokens per step / phase seconds")
    per_phase.set_title("Per phase (higher is faster; a missing bar: the side has no such phase)")
    per_phase.legend(fontsize=8)
    setup = first["setup"]
    models = sorted({r["model"] for r in runs.values()})
    fig.suptitle(f"GRPO end to end on {first['gpu'].split(',')[0]}: {', '.join(models)} random init, "
                 f"{setup['prompt_len']} + {setup['completion_len']} tokens, {setup['n_samples']} per prompt "
                 f"(commit{'s' if len(commits) > 1 else ''} {', '.join(commits)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=120)
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
