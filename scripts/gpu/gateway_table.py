"""The gateway phase's table of scripts/gpu/agent.sh: per phase and step, requests/s and model tokens/s over the
generate phase, and the gateway/agent-loop ratio of their means over steps 2 on; written to
OUT/gateway_throughput.json too.

    python scripts/gpu/gateway_table.py OUT agent gateway
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path, phase: str) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        if "agent/model_tokens_total" not in r or "train/loss" not in r:
            continue
        seconds = r["timing/generate"]
        # a gateway run's requests are its HTTP calls; the loop's are its model turns (one engine request each)
        requests = r["agent/requests"] if "agent/requests" in r else r["agent/model_turns_total"]
        out.append({"phase": phase, "step": r["step"], "generate_s": seconds, "requests": requests,
                    "requests_per_s": requests / seconds, "tokens_per_s": r["agent/model_tokens_total"] / seconds,
                    "reward": r.get("train/reward"), "dropped": r.get("agent/agents_crashed", 0)
                    + r.get("agent/agents_timed_out", 0)})
    return out


def main(out_dir: str, *phases: str) -> None:
    table = {phase: rows(Path(out_dir) / f"{phase}_metrics.jsonl", phase) for phase in phases}
    mean = {phase: {k: sum(r[k] for r in rs[1:]) / len(rs[1:]) for k in ("requests_per_s", "tokens_per_s")}
            for phase, rs in table.items() if len(rs) > 1}
    ratio = {k: mean["gateway"][k] / mean["agent"][k] for k in ("requests_per_s", "tokens_per_s")} \
        if {"gateway", "agent"} <= set(mean) else None
    (Path(out_dir) / "gateway_throughput.json").write_text(json.dumps({"steps": table, "mean_from_step_2": mean,
                                                                       "gateway_over_agent_loop": ratio}, indent=1))
    print("| phase | step | generate s | requests | requests/s | tokens/s | reward | dropped |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rs in table.values():
        for r in rs:
            print(f"| {r['phase']} | {r['step']} | {r['generate_s']:.3g} | {r['requests']:g} "
                  f"| {r['requests_per_s']:.4g} | {r['tokens_per_s']:.4g} | {r['reward']:.3g} | {r['dropped']:g} |")
    for phase, m in mean.items():
        print(f"{phase}, mean from step 2: {m['requests_per_s']:.4g} requests/s, {m['tokens_per_s']:.4g} tokens/s")
    if ratio:
        print(f"gateway / agent loop: requests/s {ratio['requests_per_s']:.3f}, tokens/s {ratio['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
