"""Entry point: python -m megarl.train --config configs/quickstart.yaml [key=value ...]"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from megarl.config import ConfigError, help_text, load_config
from megarl.config.summary import describe, profile_line
from megarl.data.files import InputError


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m megarl.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a policy with RL (and an optional supervised warm start).",
        epilog="overrides: dotted config keys, e.g. actor.parallel.tp=2 trainer.steps=20\n\noptions:" + help_text())
    parser.add_argument("--config", help="YAML recipe (only what differs from the defaults)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config and layout, the model directory (config.json, tokenizer; no weights "
                             "loaded) and every prompt, then exit")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the config and layout only, then exit: no model directory or prompt file "
                             "needed (a recipe checked on a machine without them)")
    parser.add_argument("overrides", nargs="*", help="key=value")
    return parser.parse_args(argv)


def start_ray(cfg, cpus_needed: float):
    """Join trainer.ray_address, or start a local Ray with at least `cpus_needed` logical CPUs; returns ray."""
    if not cfg.trainer.ray_address:
        # A local cluster stays on loopback: without this Ray swaps 127.0.0.1 for the host's address.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    # Ray workers inherit this: keep them from oversubscribing the CPU and from reaching any hub.
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.trainer.threads_per_rank))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.trainer.ray_address:
        ray.init(address=cfg.trainer.ray_address)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(cpus_needed + 0.999)), include_dashboard=False,
                 log_to_driver=True)
    return ray


@contextlib.contextmanager
def one_torch_thread():
    """The driver's own tensor work (row selection for the ranks, advantages, metrics) is small. Over torch's
    default pool of every core, each op waits for all its threads, and with SGLang's scheduler spinning and the
    ranks busy some are always descheduled: on a 16-core GPU host the update call's row selection took 40 ms,
    against 0.6 ms on one thread (docs/benchmarks.md, issue 22). Restored after: a caller's process goes on."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def planned_memory(cfg, model_config: dict, longest_prompt: int) -> str:
    """The dry run's memory line for the policy (megarl.reshard.plan.run_memory), checked against this machine's
    GPU when it has one. A model the planner cannot read is said, not failed: the dry run's checks passed."""
    from megarl.reshard.plan import run_memory

    agent = cfg.agent
    response = agent.max_response_tokens if agent.enabled else cfg.rollout.max_new_tokens
    try:
        line, most = run_memory(model_config, cfg.actor, cfg.rollout, cfg.algorithm.kl_coef > 0, longest_prompt,
                                response)
    except (KeyError, ValueError) as e:
        return f"predicted GPU memory: not planned ({type(e).__name__}: {e})"
    import torch

    if cfg.trainer.device == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        line += (f"; this machine's GPU holds {total / 2**30:.1f} GiB"
                 + (": it does NOT fit (python -m megarl.plan says what would)" if most > total else ""))
    return line


def run_trainer(cfg, ray, build, after=None) -> tuple[dict, object] | None:
    """Build the run's trainer, fit it and call `after(trainer)` (e.g. an export); its workers and Ray always go down
    after, and where the TensorBoard events are is printed. Returns (history, what `after` returned), or None when
    an input or config error (printed) stopped the build: found before any worker starts."""
    # SIGTERM (`timeout`, a job scheduler) exits through the finally below: SGLang servers go down with the run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with one_torch_thread():
        try:
            trainer = build(cfg)
        except (InputError, ConfigError) as e:  # a model directory, prompt or layout the run cannot use
            ray.shutdown()
            print(f"{'input' if isinstance(e, InputError) else 'config'} error: {e}", file=sys.stderr)
            return None
        try:
            history = trainer.fit()
            result = after(trainer) if after is not None else None
        finally:
            trainer.shutdown()
            ray.shutdown()
    print(f"\nTensorBoard events: {os.path.abspath(cfg.trainer.output_dir)}  "
          f"(tensorboard --logdir {cfg.trainer.output_dir})")
    return history, result


def generation_placement(r) -> str:
    """Where generation runs (the rollout section `r`), as the start-up line says it, e.g. 'sglang: 4 servers of TP 4
    on 2 server hosts of 8 GPUs (16 GPUs of their own)'."""
    if r.engine != "sglang":
        return r.engine
    if not r.sglang_gpus:
        return f"sglang: servers of TP {r.sglang_tp} on the training GPUs (colocated)"

    def count(n: int, thing: str) -> str:
        return f"{n} {thing}" + ("s" if n != 1 else "")

    per_host = r.sglang_gpus_per_host
    where = (f"{count(r.sglang_gpus // per_host, 'server host')} of {count(per_host, 'GPU')}" if per_host
             else "the rollout actor's node")
    return (f"sglang: {count(r.sglang_gpus // r.sglang_tp, 'server')} of TP {r.sglang_tp} on {where} "
            f"({count(r.sglang_gpus, 'GPU')} of their own)")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from megarl.algorithms import check_registry_names  # the registries live above the config layer

        check_registry_names(cfg.algorithm)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(profile_line(cfg))
    for note in cfg.notes:
        print(f"note: {note}")
    layout = cfg.actor.parallel.describe()
    config_ok = f"config ok: {layout}; rollout={generation_placement(cfg.rollout)}; {cfg.trainer.steps} RL steps"
    summary = "\n".join(f"  {line}" for line in describe(cfg))
    if args.check_config:
        print(config_ok)
        print(summary)
        return 0
    if args.dry_run:
        from megarl.data.inputs import check_inputs

        try:
            inputs, model_config, longest = check_inputs(cfg)
        except InputError as e:
            print(f"input error: {e}", file=sys.stderr)
            return 2
        except ConfigError as e:  # a layout the model cannot take (megarl/config/model_layout.py)
            print(f"config error: {e}", file=sys.stderr)
            return 2
        print(f"{config_ok}; {inputs}")
        print(summary)
        print(planned_memory(cfg, model_config, longest))
        return 0

    # every training rank (the policy's, the critic's, the reward model's) and the rollout actor
    ranks = (cfg.actor.parallel.world_size
             + (cfg.critic.parallel.world_size if cfg.algorithm.advantage == "gae" else 0)
             + (cfg.reward_model.parallel.world_size if cfg.reward_model.path else 0))
    ray = start_ray(cfg, ranks * cfg.trainer.cpus_per_rank + cfg.rollout.num_cpus)
    from megarl.async_trainer import build_trainer

    print(f"megarl: {layout}, device={cfg.trainer.device}, output={cfg.trainer.output_dir}\n{summary}", flush=True)
    done = run_trainer(cfg, ray, build_trainer)  # trainer.mode: the synchronous loop, or an asynchronous one
    if done is None:
        return 2
    val = done[0]["val/reward"]
    first, last = min(val), max(val)
    print(f"held-out reward: {val[first]:.3f} before RL -> {val[last]:.3f} after {last} RL steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
