"""Entry point: python -m megarl.train --config configs/quickstart.yaml [key=value ...]"""

from __future__ import annotations

import signal
import sys

from megarl import stops

if __name__ == "__main__":  # until stops.begin takes SIGINT over; the libraries below import meanwhile
    signal.signal(signal.SIGINT, stops.stopped_while_starting)

import argparse
import contextlib
import os
from pathlib import Path

from megarl.config import ConfigError, help_text, load_config
from megarl.config.summary import describe, profile_line, required_problem
from megarl.config.verl import hydra_config_flags, with_origins
from megarl.data.files import SUFFIXES, InputError, MalformedRow, iter_records
from megarl.data.run_paths import HUB_ID, missing_model, path_problems
from megarl.utils import quiet
from megarl.utils.progress import phases


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
    parser.add_argument("--config-name", help="verl's Hydra flag: its own ppo_trainer / ppo_megatron_trainer are the "
                                              "verl defaults a command of verl's keys gets anyway; another config "
                                              "file is refused (give its keys as key=value)")
    parser.add_argument("--config-path", help="verl's Hydra flag, read with --config-name")
    parser.add_argument("--verbose", action="store_true", help=quiet.VERBOSE_HELP)
    parser.add_argument("overrides", nargs="*", help="key=value")
    return parser.parse_args(argv)


def rl_gpus_needed(cfg) -> float:
    """The GPUs an RL run's actors take on cuda (megarl/workers/group.py): 0.9 of a GPU per training rank, split
    among the roles (policy, critic, reward model) that share it, and the rollout actor's SGLang GPUs, or a tenth of
    one beside the ranks."""
    sizes = [cfg.actor.parallel.world_size]
    sizes += [cfg.critic.parallel.world_size] if cfg.algorithm.advantage == "gae" else []
    sizes += [cfg.reward_model.parallel.world_size] if cfg.reward_model.path else []
    return 0.9 * sum(sizes) / len(sizes) + (cfg.rollout.sglang_gpus or 0.1)


def stopped_by(error: Exception) -> int:
    """main()'s exit status 2 for an error found before training starts, printed as one line on stderr that names its
    kind: a config error (ConfigError), an input error (InputError), else plain error."""
    kind = "config " if isinstance(error, ConfigError) else "input " if isinstance(error, InputError) else ""
    print(f"{kind}error: {error}", file=sys.stderr)
    return 2


def refuse(problem: str):
    """Ends the run as main() ends one on a config error."""
    raise SystemExit(stopped_by(ConfigError(problem)))


def cluster_to_join(cfg) -> tuple[str, str] | None:
    """The Ray cluster this run joins and what named it, in this order: trainer.ray_address; RAY_ADDRESS (what `ray
    job submit` sets for its driver); the cluster that the last `ray start` on this node recorded, while it answers.
    None: start a local one (also trainer.ray_address=local); trainer.ray_address=auto joins or fails."""
    import socket

    address = cfg.trainer.ray_address
    if address not in ("", "auto", "local"):
        return address, "trainer.ray_address"
    if address == "local":
        return None
    env = os.environ.get("RAY_ADDRESS", "")
    if env and not env.startswith(("http://", "https://")):  # a dashboard's URL serves `ray job`, not a driver
        return env, "RAY_ADDRESS"
    # Where `ray start` records it (Ray's get_ray_address_file), read before Ray is imported: see start_ray.
    record = os.path.join(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp", "ray",
                          "ray_current_cluster")
    try:
        with open(record) as f:
            found = f.read().strip()
        host, _, port = found.rpartition(":")
        socket.create_connection((host, int(port)), timeout=5).close()
        return found, record
    except (OSError, ValueError):  # none; or stale: a node ended without `ray stop` leaves its record behind
        pass
    if address == "auto":
        refuse(f"trainer.ray_address=auto: no Ray cluster to join (RAY_ADDRESS is unset, and {record} names no live "
               "one): start one (ray start --head) or name it, trainer.ray_address=IP:PORT")
    return None


def start_ray(cfg, cpus_needed: float, gpus_needed: float | None = None):
    """Join the Ray cluster that cluster_to_join finds, after checking that it has the CPUs (and on cuda the GPUs:
    `gpus_needed`, an RL run's by default) the run needs; else start a local Ray with at least `cpus_needed` logical
    CPUs. Returns ray. ray.shutdown() at the end of the run leaves a joined cluster up: it only disconnects."""
    join = cluster_to_join(cfg)
    host = join[0].split("://")[-1].rpartition(":")[0] if join else ""
    if join is None or host.startswith("127.") or host == "localhost":
        # Ray keeps 127.0.0.1 as this node's address, which it reads when imported: a local cluster stays on loopback,
        # and one that listens there only (ray_cluster.sh head without --ip) can be joined. Without it, Ray swaps
        # 127.0.0.1 for the host's address; a cluster on every interface is joined either way.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    # Ray workers inherit this: keep them from oversubscribing the CPU and from reaching any hub.
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.trainer.threads_per_rank))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if join is None:
        # "local": a new Ray even beside a cluster that Ray would find itself (it refuses num_cpus for one it joins)
        with phases("starting a local Ray cluster"), own_sessions():
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(cpus_needed + 0.999)),
                     include_dashboard=False, log_to_driver=True)
        return ray
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    # Where RAY_AUTH_MODE is unset, use this node's token if it has one, as `ray start` does: a cluster that `ray
    # start` brought up where a token exists (any local ray.init() writes ~/.ray/auth_token) refuses clients without.
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    address, source = join
    ray.init(address=address)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    cpus, gpus = (sum(n["Resources"].get(key, 0.0) for n in nodes) for key in ("CPU", "GPU"))
    print(f"megarl: joined the Ray cluster at {address} ({source}): {len(nodes)} node(s), {cpus:g} CPUs "
          f"({ray.available_resources().get('CPU', 0.0):g} free), {gpus:g} GPUs", flush=True)
    from megarl.trainer import resolve_device

    if resolve_device(cfg) != "cuda":
        gpus_needed = 0.0
    elif gpus_needed is None:
        gpus_needed = rl_gpus_needed(cfg)
    short = []
    if cpus < cpus_needed:  # the placement group would wait for them until its timeout
        short.append(f"{cpus_needed:g} CPUs, and it has {cpus:g}: trainer.cpus_per_rank={cfg.trainer.cpus_per_rank:g} "
                     "per training rank (actor/critic/reward_model.parallel.world_size of them) and, in an RL run, "
                     f"rollout.num_cpus={cfg.rollout.num_cpus:g} set it")
    if gpus < gpus_needed - 1e-6:
        short.append(f"{gpus_needed:g} GPUs, and it has {gpus:g}: 0.9 of one per training rank (the world sizes) "
                     f"and rollout.sglang_gpus={cfg.rollout.sglang_gpus} set it")
    if short:
        ray.shutdown()
        refuse(f"the Ray cluster at {address} is too small for this run, which needs " + "; and ".join(short)
               + ". Lower them, or give the cluster more (ray start --num-cpus/--num-gpus on its nodes, or more nodes)")
    return ray


@contextlib.contextmanager
def own_sessions():
    """The processes a local ray.init starts (GCS, raylet, log monitor; the raylet's workers and agents inherit
    theirs) each in a session of its own. A signal to the driver's process group (Ctrl-C, `timeout`, a scheduler's
    SIGTERM to the job) then reaches the driver alone, which stops the run (megarl/stops.py) and ends Ray itself;
    inside the group, SIGTERM ended the GCS first and the driver died on "Failed to connect to GCS". Ray has no
    option for it: its children call ray._private.utils.set_kill_on_parent_death_linux between fork and exec (they
    still die with the driver by that call; the run's lease ends what is left: megarl/workers/lease.py), so setsid
    joins that call while Ray starts. tests/test_stops.py fails if Ray stops calling it."""
    from ray._private import utils

    die_with_parent = utils.set_kill_on_parent_death_linux

    def detach_and_die_with_parent():
        os.setsid()
        die_with_parent()

    utils.set_kill_on_parent_death_linux = detach_and_die_with_parent
    try:
        yield
    finally:
        utils.set_kill_on_parent_death_linux = die_with_parent


@contextlib.contextmanager
def one_torch_thread():
    """The driver's own tensor work (row selection for the ranks, advantages, metrics) is small. Over torch's
    default pool of every core, each op waits for all its threads, and with SGLang's scheduler spinning and the
    ranks busy some are always descheduled: on a 16-core GPU host the update call's row selection took 40 ms,
    against 0.6 ms on one thread. Restored after: a caller's process goes on."""
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
    an input or config error (printed) stopped the build: found before any worker starts. After a SIGINT or SIGTERM
    the loop stopped for (megarl/stops.py), `after` is skipped, and stops.end exits with the stop line."""
    with one_torch_thread():
        try:
            trainer = build(cfg)
        except (InputError, ConfigError) as e:  # a model directory, prompt or layout the run cannot use
            ray.shutdown()
            stops.end()
            stopped_by(e)
            return None
        try:
            history = trainer.fit()
            result = after(trainer) if after is not None and not stops.requested() else None
        finally:
            trainer.shutdown()
            ray.shutdown()
            stops.end()
    print(f"\nmetrics.jsonl and TensorBoard events: {os.path.abspath(trainer.tracker.directory)}  "
          f"(tensorboard --logdir {cfg.trainer.output_dir}: each run of this output directory apart)")
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


def first_prompt_row(cfg) -> dict | None:
    """The training prompt file's first row, where data.task names one that is there: the reward is tried on it."""
    if not cfg.data.task.endswith(SUFFIXES) or not Path(cfg.data.task).is_file():
        return None
    for _, record in iter_records(cfg.data.task):
        return None if isinstance(record, MalformedRow) else record  # a malformed row is the prompt loader's to name
    return None


def reward_key(cfg) -> str:
    """The key a reward's errors name: verl's custom_reward_function.path where a verl command named it."""
    return "custom_reward_function.path" if cfg.profile == "verl" and cfg.reward.name else "reward.name"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    quiet.install(args.verbose)  # before megatron and transformers are imported, here and in every worker
    try:
        cfg = load_config(args.config, args.overrides)
        if hydra_note := hydra_config_flags(args.config_name, args.config_path, cfg.profile):
            cfg.notes = [hydra_note, *cfg.notes]
        from megarl.algorithms import check_registry_names  # the registries live above the config layer
        from megarl.rewards.loading import check_reward
        from megarl.utils.tracking import check_loggers

        if problem := required_problem(cfg):  # before the reward is tried on a prompt file that is not named
            raise ConfigError(problem)
        check_registry_names(cfg.algorithm)
        check_loggers(cfg.trainer.loggers)
        reward = check_reward(cfg, first_prompt_row(cfg), reward_key(cfg))  # imported and tried before anything starts
    except (ConfigError, InputError) as e:
        return stopped_by(e)
    print(profile_line(cfg))
    for note in cfg.notes:
        print(f"note: {note}")
    layout = cfg.actor.parallel.describe()
    config_ok = f"config ok: {layout}; rollout={generation_placement(cfg.rollout)}; {cfg.trainer.steps} RL steps"
    summary = "\n".join(f"  {line}" for line in describe(cfg) + [reward])
    if args.check_config:
        print(config_ok)
        print(summary)
        if cfg.model.path != "tiny" and Path(cfg.model.path).is_dir():  # the model is on this machine: its eos token
            from megarl.data.inputs import eos_disagreement, load_tokenizer

            try:
                eos = eos_disagreement(cfg.model.path, load_tokenizer(cfg.model.path), cfg.rollout.engine)
            except InputError:  # a tokenizer that does not load: --dry-run names it
                eos = None
            if eos:
                print(f"warning: {eos}")
        elif HUB_ID.fullmatch(cfg.model.path):  # not needed here, but a run anywhere needs a local copy
            print(f"warning: model.path={cfg.model.path}: {missing_model(cfg.model.path)}")
        return 0
    if problems := path_problems(cfg):  # every one named at once, before anything loads and before Ray starts
        return stopped_by(InputError("; ".join(with_origins(problem, cfg.origins) for problem in problems)))
    if args.dry_run:
        from megarl.data.inputs import check_inputs

        try:
            inputs, model_config, longest = check_inputs(cfg)
        except (InputError, ConfigError) as e:  # ConfigError: a layout the model cannot take (config/model_layout.py)
            return stopped_by(e)
        print(f"{config_ok}; {inputs}")
        print(summary)
        print(planned_memory(cfg, model_config, longest))
        return 0

    from megarl.engine.checkpoint_dir import CheckpointError
    from megarl.resume import claim_run
    from megarl.utils.run_lock import RunLockError

    try:  # before Ray and the workers: one live run per directory, the checkpoint it resumes checked (resume.py)
        lock, start = claim_run(cfg)
    except (RunLockError, CheckpointError, ConfigError) as e:
        return stopped_by(e)
    with lock:  # released when the run ends, however it ends
        if finished := start.nothing_to_train(cfg.trainer.steps):
            print(finished)
            return 0
        # every training rank (the policy's, the critic's, the reward model's) and the rollout actor
        ranks = (cfg.actor.parallel.world_size
                 + (cfg.critic.parallel.world_size if cfg.algorithm.advantage == "gae" else 0)
                 + (cfg.reward_model.parallel.world_size if cfg.reward_model.path else 0))
        stops.begin(cfg)  # SIGINT/SIGTERM end the run from here; so do the processes it starts
        ray = start_ray(cfg, ranks * cfg.trainer.cpus_per_rank + cfg.rollout.num_cpus)
        stops.reclaim_signals()  # from Ray's SIGTERM handlers, which ray.init installed
        from megarl.async_trainer import build_trainer

        print(f"megarl: {layout}, device={cfg.trainer.device}, output={cfg.trainer.output_dir}, "
              f"run {start.run_id} ({'resumed' if start.step else 'new'})\n{summary}", flush=True)
        # trainer.mode: the synchronous loop, or an asynchronous one
        done = run_trainer(cfg, ray, lambda c: build_trainer(c, start))
    if done is None:
        return 2
    val = done[0]["val/reward"]
    first, last = min(val), max(val)
    print(f"held-out reward: {val[first]:.3f} before RL -> {val[last]:.3f} after {last} RL steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
