"""What `rollout.deterministic` costs and what it buys, on one GPU (GPU only; --dry-run checks the plumbing).

Two SGLang servers of one random model (dummy weights), one as megarl starts it by default and one in SGLang's
deterministic-inference mode (`rollout.deterministic=true`), alive at once and measured in turns: each round
gives every server a fresh batch of random prompts (n samples each, completions forced to full length) and
times it; a path's tok/s is its median over the rounds. Then each server generates one batch twice with the
same seed: in deterministic mode the two must be equal token for token (what lets a resumed run regenerate its
responses), by default they are not.

    python benchmarks/rollout_deterministic.py --out docs/results/deterministic.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.reshard.plan import load_model_config  # noqa: E402
from megarl.rollout.base import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mem-fraction", type=float, default=0.35)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="no GPU: check the arguments and write the JSON")
    args = parser.parse_args(argv)
    result = vars(args).copy()
    if not args.dry_run:
        result |= measure(args)
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def measure(args) -> dict:
    from megarl.rollout.sglang import SGLangRolloutEngine

    model_dir = Path(tempfile.mkdtemp(prefix=f"{args.model}-"))
    (model_dir / "config.json").write_text(json.dumps(load_model_config(args.model)))
    g = torch.Generator().manual_seed(0)
    batch = lambda: torch.randint(100, 10000, (args.prompts, args.prompt_len), generator=g).tolist()  # noqa: E731
    engines = {mode: SGLangRolloutEngine(str(model_dir), colocated=False, load_format="dummy",
                                         mem_fraction=args.mem_fraction, memory_saver=False, log_dir=args.log_dir,
                                         sampling_overrides={"ignore_eos": True}, deterministic=mode == "on",
                                         batch_rows=args.prompts * args.n)
               for mode in ("off", "on")}
    try:
        params = SamplingParams(max_new_tokens=args.new_tokens, n=args.n, temperature=1.0, seed=1234)
        rates: dict[str, list[float]] = {mode: [] for mode in engines}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for mode in (("off", "on") if round_ % 2 else ("on", "off")):
                t = time.perf_counter()
                tokens = sum(len(x.token_ids) for x in engines[mode].generate(batch(), params))
                if round_:
                    rates[mode].append(tokens / (time.perf_counter() - t))
        same = {}
        prompts = batch()
        for mode, engine in engines.items():
            for server in engine.servers:
                server.post("/flush_cache")
            first = [x.token_ids for x in engine.generate(prompts, params)]
            second = [x.token_ids for x in engine.generate(prompts, params)]
            same[mode] = sum(a == b for a, b in zip(first, second)) / len(first)
        off, on = (statistics.median(rates[m]) for m in ("off", "on"))
        return {"tok_s_off": off, "tok_s_on": on, "cost": 1 - on / off, "rounds_tok_s": rates,
                "same_responses_repeated_off": same["off"], "same_responses_repeated_on": same["on"],
                "gpu": torch.cuda.get_device_name()}
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
