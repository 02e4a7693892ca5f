"""Entry point: python -m megarl.train_rm --config configs/rm_quickstart.yaml [key=value ...]

Trains a Bradley-Terry reward model on preference pairs (megarl/rm_trainer.py) and writes it as a HF directory
at reward_model.path, which RL takes as reward_model.path (docs/reward_model.md).
"""

from __future__ import annotations

import signal
import sys

from megarl import stops

if __name__ == "__main__":  # until stops.begin takes SIGINT over; the libraries below import meanwhile
    signal.signal(signal.SIGINT, stops.stopped_while_starting)

import argparse

from megarl.config import ConfigError, help_text, load_config
from megarl.data.files import InputError
from megarl.utils import quiet

SECTIONS = ("model", "reward_model", "preference", "trainer")  # what train_rm reads (and data.min_len/max_len)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m megarl.train_rm", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a Bradley-Terry reward model on preference pairs, in the Megatron engine, and write it "
                    "as a HF directory (reward_model.path) for RL.",
        epilog="overrides: dotted config keys, e.g. reward_model.parallel.tp=2 trainer.steps=200\n\n"
               "the model: model.* (its base); its layout and optimizer: reward_model.*; the pairs: preference.*; the "
               "loop: trainer.steps, eval_every, output_dir, seed, device, save_every, resume, loggers, ... (the "
               "weight-sync and rollout keys do not apply)\n\noptions:" + help_text(SECTIONS))
    parser.add_argument("--config", help="YAML recipe (only what differs from the defaults)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config and layout, the model directory (config.json, tokenizer; no weights "
                             "loaded), the export path and every preference pair, then exit")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the config and layout only, then exit: no model directory or pair file needed")
    parser.add_argument("--verbose", action="store_true", help=quiet.VERBOSE_HELP)
    parser.add_argument("overrides", nargs="*", help="key=value")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    quiet.install(args.verbose)  # before megatron and transformers are imported, here and in every worker
    from megarl.data.run_paths import rm_path_problems
    from megarl.rm_trainer import RMTrainer, check_rm_config, check_rm_inputs
    from megarl.train import run_trainer, start_ray, stopped_by

    try:
        cfg = load_config(args.config, args.overrides)
        check_rm_config(cfg)
    except ConfigError as e:
        return stopped_by(e)
    layout = cfg.reward_model.parallel.describe()
    config_ok = (f"config ok: {layout}; {cfg.trainer.steps} steps of {cfg.preference.pairs_per_step} preference "
                 f"pairs")
    if args.check_config:
        print(config_ok)
        return 0
    if problems := rm_path_problems(cfg):  # every one named at once, before anything loads and before Ray starts
        return stopped_by(InputError("; ".join(problems)))
    if args.dry_run:
        try:
            print(f"{config_ok}; {check_rm_inputs(cfg)}")
        except (InputError, ConfigError) as e:
            return stopped_by(e)
        return 0

    ranks = cfg.reward_model.parallel.world_size  # the run's only engine: 0.9 of a GPU each on cuda
    stops.begin(cfg)  # SIGINT/SIGTERM end the run from here; so do the processes it starts
    ray = start_ray(cfg, ranks * cfg.trainer.cpus_per_rank, gpus_needed=0.9 * ranks)
    stops.reclaim_signals()  # from Ray's SIGTERM handlers, which ray.init installed
    print(f"megarl reward model: {layout}, device={cfg.trainer.device}, output={cfg.trainer.output_dir}", flush=True)
    done = run_trainer(cfg, ray, RMTrainer, RMTrainer.export)
    if done is None:
        return 2
    history, exported = done
    accuracy = history["val/pair_accuracy"]
    first, last = min(accuracy), max(accuracy)
    print(f"held-out pair accuracy: {accuracy[first]:.3f} before training -> {accuracy[last]:.3f} after {last} steps "
          f"(margin {history['val/margin'][last]:.3f})")
    print(f"reward model: {exported}  (RL: reward_model.path={exported})")
    return 0


if __name__ == "__main__":  # required: megatron's checkpoint writer starts a spawn-context process
    sys.exit(main())
