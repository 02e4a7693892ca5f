"""Ray placement of the training ranks and the rollout actor, and Batch dispatch by data-parallel rank.

The driver only sees Batches: `TrainGroup` splits one into equal chunks, one per data-parallel rank,
hands every rank of a model-parallel group the same chunk, and returns the results of the first rank
of each data-parallel group, concatenated in order.

Every wait on a worker has a deadline (trainer.worker_timeout_s): a rank that stops responding (stopped, stuck
in a collective, deadlocked) fails the call naming it and the call, instead of hanging the driver for good.
"""

from __future__ import annotations

import re
import time
from typing import Callable, Iterator

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from megarl.config import Config
from megarl.config.validation import env_strings
from megarl.protocol import Batch
from megarl.utils import quiet
from megarl.workers.placement import place
from megarl.workers.rollout_worker import RolloutWorker
from megarl.engine.packing import balanced_partition, sequence_lengths
from megarl.workers.train_worker import ROLES, TrainWorker


class WorkerError(RuntimeError):
    """A worker's call failed, or its worker died; the message names the worker and the call."""


class WorkerTimeout(WorkerError):
    """Workers did not answer a call within trainer.worker_timeout_s; the message names them and the call."""


def get_all(refs: list, call: str = "the call", describe: Callable[[int], str] = "worker {}".format,
            timeout: float = 0.0) -> list:
    """Every worker's result, in order; raises as soon as one fails (WorkerError naming `describe(i)` and `call`),
    or WorkerTimeout once `timeout` seconds (0: none) have passed with some not answered. ray.get of the list
    would wait for every rank first, and the other ranks of a failed one may wait for it in a collective (a
    resharding gather, a gradient all-reduce) until NCCL's timeout, or forever on gloo."""
    deadline = time.monotonic() + timeout if timeout else None
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            late = sorted(index[ref] for ref in pending)
            raise WorkerTimeout(f"{', '.join(map(describe, late))} did not answer {call} within {timeout:g} s "
                                "(trainer.worker_timeout_s)")
        try:
            ray.get(done)
        except ray.exceptions.RayError as error:
            remote = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Ray colours the remote traceback for terminals
            raise WorkerError(f"{describe(index[done[0]])} failed in {call}: {remote}") from error
    return ray.get(refs)


# The rollout actors megarl killed for missing a deadline, by actor id: the hang's message. In the asynchronous modes
# the rollout thread and the trainer wait on the one actor at once; the deadline of one kills it, and the other's call
# then fails with a death that is this hang.
_hung_rollouts: dict[str, str] = {}


def rollout_process(rollout) -> str:
    """What the OS says of the rollout actor's process (process_state), looked up in Ray's actor table: a hung actor
    cannot be asked."""
    info = ray._private.state.actors(rollout._actor_id.hex())  # Ray's only lookup without the dashboard
    if not info.get("Pid"):
        return "not started"
    return process_state(info["Pid"], info["Address"]["IPAddress"])


def kill_hung_rollout(rollout, what: str) -> str:
    """Kill the rollout actor (its SGLang servers' guards end them: megarl/rollout/server_guard.py) for the hang
    `what` says, which reads on with its process state ('the rollout actor (pid 7, stopped)' + what); returns the
    message, which every other wait on the actor then reports (rollout_result)."""
    message = f"the rollout actor ({rollout_process(rollout)}){what}; killed it (and so its servers)"
    ray.kill(rollout)
    _hung_rollouts[rollout._actor_id.hex()] = message
    return message


def rollout_result(rollout, ref, method: str):
    """ray.get of a call on the rollout actor (WorkerError naming it and the call); where megarl killed the actor for
    a hang while this call waited, WorkerTimeout with that hang, not the death it caused."""
    try:
        return get_all([ref], method, lambda _: "the rollout actor")[0]
    except WorkerError as error:
        hang = _hung_rollouts.get(rollout._actor_id.hex())
        if hang is None or not isinstance(error.__cause__, ray.exceptions.RayActorError):
            raise
        raise WorkerTimeout(f"{hang} (the call {method} ended with it)") from None


def rollout_hang_behind(error: WorkerError, rollout, call: str, doing: str) -> WorkerTimeout | None:
    """The hang behind a failed `call` of the training ranks that waits on the rollout actor (a weight sync): past
    the call's deadline, the rollout actor named after the ranks, with its state (stopped: the cause) and what it was
    `doing` for them, and killed too; failed because megarl killed the actor for a hang meanwhile (the rollout
    thread's deadline), that hang. None for any other failure."""
    if isinstance(error, WorkerTimeout):
        return WorkerTimeout(f"{error}; " + kill_hung_rollout(rollout, f" was {doing} ({call})"))
    hang = _hung_rollouts.get(rollout._actor_id.hex())
    return WorkerTimeout(f"{hang} (the training ranks' {call} ended with it)") if hang else None


def _rollout_deadline(rollout, method: str, timeout: float) -> WorkerTimeout:
    return WorkerTimeout(kill_hung_rollout(rollout, f" did not answer {method} within {timeout:g} s "
                                                    "(trainer.worker_timeout_s)"))


def call_rollout(rollout, method: str, *args, timeout: float = 0.0):
    """rollout.method(*args) on the rollout actor, with the same deadline as the training ranks' calls; past it the
    actor is killed at once, as a shutdown call would only queue behind the hung one."""
    ref = getattr(rollout, method).remote(*args)
    if not ray.wait([ref], timeout=timeout or None)[0]:
        raise _rollout_deadline(rollout, method, timeout)
    return rollout_result(rollout, ref, method)


def stream_rollout(rollout, method: str, *args, timeout: float = 0.0) -> Iterator:
    """The items of rollout.method(*args), a generator on the rollout actor, as each is made; the wait for each has
    call_rollout's deadline (past it the actor is killed)."""
    stream = getattr(rollout, method).options(num_returns="streaming").remote(*args)
    while True:
        if not ray.wait([stream], timeout=timeout or None)[0]:
            raise _rollout_deadline(rollout, method, timeout)
        try:
            ref = next(stream)
        except StopIteration:
            return
        yield rollout_result(rollout, ref, method)


def process_state(pid: int, node: str) -> str:
    """What the OS says of a worker's process, where the driver can look (its own node): 'stopped' for a SIGSTOP,
    'sleeping' for one waiting (in a collective?), 'running' for one spinning."""
    if node != ray.util.get_node_ip_address():
        return f"pid {pid} on {node}"
    try:
        return f"pid {pid}, {psutil.Process(pid).status()}"
    except psutil.NoSuchProcess:
        return f"pid {pid}, gone"


class TrainGroup:
    def __init__(self, cfg: Config, model_path: str, device: str, total_steps: int, role: str = "actor"):
        """role: actor, critic, reward_model or reward_model_training (train_worker.ROLES), each on its own config
        section's layout."""
        self.section, self.role = getattr(cfg, ROLES[role][0]), role
        self.timeout = cfg.trainer.worker_timeout_s  # every wait on a rank (get_all)
        self.killed = False  # after a rank missed its deadline: every actor killed
        n = self.section.parallel.world_size
        # On GPU the roles (actor, critic, reward model) share each GPU, and keep a sliver of it free for a
        # colocated rollout actor (see start_rollout). train_rm's reward model is the only engine of its run.
        roles = 1 if role == "reward_model_training" else (
            1 + (cfg.algorithm.advantage == "gae") + bool(cfg.reward_model.path))
        bundle = {"CPU": cfg.trainer.cpus_per_rank} | ({"GPU": 0.9 / roles} if device == "cuda" else {})
        self.pg = place(bundle, n, cfg.trainer.placement, f"the {role} ranks")
        actor = ray.remote(TrainWorker)
        env = env_strings(cfg.trainer.worker_env) | quiet.env()  # quiet's: a joined cluster's workers do not inherit
        options = {"runtime_env": {"env_vars": env}} if env else {}
        self.workers = [
            actor.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i), **options)
            .remote(i, cfg, model_path, device, role)
            for i in range(n)]
        self.info = []
        addr, port = self._get_all([self.workers[0].address.remote()], "address (the first call: the actor's start)")[0]
        self.info = self._get_all([w.setup.remote(addr, port, total_steps) for w in self.workers], "setup")
        self.dp = self.section.parallel.dp
        # the first global rank of each data-parallel rank returns results for its chunk
        self.leaders = [min(i["rank"] for i in self.info if i["dp_rank"] == d) for d in range(self.dp)]

    def _rows_per_rank(self, batch: Batch, group_size: int = 1) -> list[list[int]]:
        """Equal consecutive chunks; with packing, equal row counts of near-equal token totals. Groups of
        `group_size` consecutive rows (preference pairs) stay together."""
        if self.section.max_tokens_per_micro_batch > 0:
            return balanced_partition(sequence_lengths(batch["attention_mask"]), self.dp, group_size)
        size = len(batch) // self.dp
        if size * self.dp != len(batch) or size % group_size:
            raise ValueError(f"cannot split a batch of {len(batch)} into {self.dp} equal chunks of whole groups of "
                             f"{group_size} rows")
        return [list(range(d * size, (d + 1) * size)) for d in range(self.dp)]

    def _dispatch(self, method: str, batch: Batch, group_size: int = 1, **kwargs) -> list:
        rows, batch = self._rows_per_rank(batch, group_size), batch.model_inputs()
        refs = [getattr(w, method).remote(batch.index(rows[info["dp_rank"]]), **kwargs)
                for w, info in zip(self.workers, self.info)]
        results = self._get_all(refs, method)
        return [results[r] for r in self.leaders]

    def _dispatch_rows(self, method: str, batch: Batch, **kwargs) -> Batch:
        """A per-row result of every data-parallel rank, back in the batch's row order."""
        order = [i for rows in self._rows_per_rank(batch) for i in rows]
        result = Batch.concat(self._dispatch(method, batch, **kwargs))
        return result.index(sorted(range(len(order)), key=order.__getitem__))

    def compute_logprobs(self, batch: Batch, with_entropy: bool = False, reference: bool = False,
                         with_sum_pi_squared: bool = False) -> Batch:
        return self._dispatch_rows("compute_logprobs", batch, with_entropy=with_entropy, reference=reference,
                                   with_sum_pi_squared=with_sum_pi_squared)

    def compute_values(self, batch: Batch) -> Batch:
        return self._dispatch_rows("compute_values", batch)

    def compute_rewards(self, batch: Batch) -> Batch:
        return self._dispatch_rows("compute_rewards", batch)

    def train(self, batch: Batch, loss: str = "policy", lr: float | None = None) -> dict[str, float]:
        # metrics are already reduced over data-parallel ranks inside the engine
        # a preference pair's two rows go to one rank (the engine keeps them in one micro-batch)
        called = time.time()
        metrics = self._dispatch("train", batch, group_size=2 if loss == "bradley_terry" else 1, loss=loss, lr=lr)[0]
        if "started_at" in metrics:  # the call's way in: Ray, the batch, a rank still busy (one clock: colocated)
            metrics["dispatch_seconds"] = metrics.pop("started_at") - called
        return metrics

    def gpus(self) -> list[tuple[str, list[str]]]:
        """The ranks' GPUs by node, for colocated rollout servers: (Ray node id, its GPU ids as Ray names them) per
        node, nodes and GPUs in rank order (rank 0's node first: the sending rank's, start_rollout)."""
        nodes: dict[str, dict[str, None]] = {}
        for info in self.info:
            nodes.setdefault(info["node_id"], {}).update(dict.fromkeys(info["gpus"]))
        return [(node, list(gpus)) for node, gpus in nodes.items()]

    def call(self, method: str, *args, **kwargs) -> list:
        """Run a method on every rank (collectives need all of them); results in rank order."""
        return self._get_all([getattr(w, method).remote(*args, **kwargs) for w in self.workers], method)

    def _get_all(self, refs: list, method: str) -> list:
        """get_all over every rank (or the first alone); past the deadline every rank is killed at once: the others
        of a silent rank wait for it in collectives, and nothing the group holds can be used again."""
        try:
            return get_all(refs, method, self._describe, self.timeout)
        except WorkerTimeout as error:
            self.kill()
            raise WorkerTimeout(f"{error}; killed all {len(self.workers)} {self.role} ranks") from None

    def kill(self) -> None:
        """Every rank killed at once: the others of a silent or lost rank wait for it in collectives."""
        for w in self.workers:
            ray.kill(w)
        self.killed = True

    def _describe(self, rank: int) -> str:
        if rank >= len(self.info):  # before setup has answered
            return f"{self.role} rank {rank}"
        return f"{self.role} rank {rank} ({process_state(self.info[rank]['pid'], self.info[rank]['node'])})"

    def shutdown(self) -> None:
        if not self.killed:
            stop_ranks(self.workers)
        ray.util.remove_placement_group(self.pg)


def stop_ranks(workers: list, timeout: float = 60.0) -> None:
    """Every rank releases what it holds (weight groups, process groups), then the actors are killed. After a
    failed call the other ranks may still be inside a collective with the failed one, their actors busy for
    good: those are killed as they are after `timeout` (waiting for them hung a failed GPU run until its limit)."""
    refs = [w.shutdown.remote() for w in workers]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    try:
        ray.get(done)
    except ray.exceptions.RayError as error:
        print(f"megarl: a training rank failed to shut down ({error}); killing the ranks", flush=True)
    if pending:
        print(f"megarl: {len(pending)} of {len(refs)} training ranks still busy after {timeout:.0f} s (in a "
              "collective with a failed rank?); killing them", flush=True)
    for w in workers:
        ray.kill(w)


def quiet_options() -> dict:
    """An actor's options that carry the run's warning filter (megarl/utils/quiet.py) to it: the workers of a cluster
    the driver joined do not inherit its environment."""
    return {"runtime_env": {"env_vars": quiet.env()}} if quiet.env() else {}


def start_rollout(cfg: Config, model_path: str, device: str, gpus: list[tuple[str, list[str]]] | None = None):
    """The rollout actor. On CPU it gets its own CPUs, so the training bundles cannot starve it.
    - Colocated (`gpus`: the training ranks' GPUs by node, TrainGroup.gpus): on one node, the actor starts its servers
      on those GPUs, placed on that node; on several, a server host on each node starts that node's servers
      (start_colocated_hosts).
    - Disaggregated (rollout.sglang_gpus): Ray gives the actor whole GPUs of its own (none of the training bundles'
      fractions) and its servers go there, or, with rollout.sglang_gpus_per_host, to server hosts on any nodes
      (start_server_hosts)."""
    r = cfg.rollout
    left = ray.available_resources().get("GPU", 0.0)  # after the training bundles: an actor asking more waits forever
    if r.sglang_gpus > int(left):
        raise RuntimeError(f"rollout.sglang_gpus={r.sglang_gpus}: Ray has {left:g} GPU(s) left beside the "
                           "training ranks; SGLang servers need whole GPUs of their own")
    hosts, sender_node, placement = None, None, {}
    if r.sglang_gpus_per_host:
        hosts = start_server_hosts(cfg)
    elif gpus and len(gpus) > 1:  # full: rank 0 sends to every node; sharded: each node's ranks to its servers
        hosts = start_colocated_hosts(cfg, gpus, device)
        sender_node = gpus[0][0] if r.weight_delivery == "full" else None
    elif gpus:  # the servers are this actor's children: it goes on the training ranks' node
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(gpus[0][0], soft=False)}
    largest = max((n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]), default=0.0)
    if not hosts and r.sglang_gpus > largest:  # the actor takes them all on one node: else it would wait forever
        raise RuntimeError(f"rollout.sglang_gpus={r.sglang_gpus}: the SGLang servers run on the rollout actor's node, "
                           f"and the largest node of this Ray cluster has {largest:g} GPU(s); "
                           "rollout.sglang_gpus_per_host spreads them over nodes")
    gpus_wanted = 0 if hosts else r.sglang_gpus or (0.1 if device == "cuda" else 0)
    # the asynchronous modes pause and resume the engine, and evaluate, while the rollout thread's generate runs
    concurrency = 1 if cfg.trainer.mode == "sync" else 4
    return ray.remote(RolloutWorker).options(num_cpus=r.num_cpus, num_gpus=gpus_wanted, max_concurrency=concurrency,
                                             **placement, **quiet_options()).remote(
        cfg, model_path, device, max(1, int(r.num_cpus)), gpus[0][1] if gpus and not hosts else None, hosts,
        sender_node)


def start_colocated_hosts(cfg: Config, gpus: list[tuple[str, list[str]]], device: str, placement_s: float = 120.0,
                          factory: Callable | None = None) -> list[tuple[object, int, list[str]]]:
    """Colocated servers for training ranks on several nodes: a server host on each node (pinned there, with a
    sliver of one of its GPUs, as the rollout actor has on one node), whose servers go on that node's training GPUs
    in rank order; returns (actor, its number of servers, those GPUs) each. Full delivery: whole tensors from rank
    0, by CUDA IPC to the servers of its node and NCCL broadcast to the others; sharded: each generation TP group's
    rows to the server on its GPUs, by CUDA IPC (TrainWorker._push_weights)."""
    from megarl.rollout.server_host import ServerHost

    tp = cfg.rollout.sglang_tp
    for node, node_gpus in gpus:
        if len(node_gpus) % tp:
            raise RuntimeError(f"rollout.sglang_tp={tp}: node {node[:8]} holds {len(node_gpus)} training GPU(s) "
                               f"({','.join(node_gpus)}); a colocated server cannot span nodes")
    hosts = [ray.remote(ServerHost).options(
        num_cpus=0, num_gpus=0.1 if device == "cuda" else 0, max_concurrency=len(node_gpus) // tp + 4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), **quiet_options()).remote(
            *([factory] if factory else []))
        for node, node_gpus in gpus]
    wait_placed(hosts, f"colocated servers on {len(gpus)} nodes", placement_s)
    print(f"megarl: colocated SGLang servers on {len(gpus)} nodes: "
          + "; ".join(ray.get([h.where.remote(node_gpus) for h, (_, node_gpus) in zip(hosts, gpus)])), flush=True)
    return [(host, len(node_gpus) // tp, node_gpus) for host, (_, node_gpus) in zip(hosts, gpus)]


def start_server_hosts(cfg: Config, placement_s: float = 120.0,
                       factory: Callable | None = None) -> list[tuple[object, int, None]]:
    """rollout.sglang_gpus / rollout.sglang_gpus_per_host server hosts (megarl/rollout/server_host.py), each a Ray
    actor holding that many GPUs of one node; returns (actor, its number of servers, None: its own GPUs) each.
    Refused before placing any when the nodes cannot hold them, and ended when Ray has not placed them all within
    `placement_s`.
    `factory`: the hosts' stand-in of sglang_server (tests)."""
    from megarl.rollout.server_host import ServerHost

    r = cfg.rollout
    per_host, count = r.sglang_gpus_per_host, r.sglang_gpus // r.sglang_gpus_per_host
    room = sum(int(n["Resources"].get("GPU", 0.0) // per_host) for n in ray.nodes() if n["Alive"])
    if room < count:
        raise RuntimeError(f"rollout.sglang_gpus={r.sglang_gpus} in server hosts of rollout.sglang_gpus_per_host="
                           f"{per_host}: {count} hosts, and this Ray cluster's nodes have room for {room} of "
                           f"{per_host} GPUs")
    servers = per_host // r.sglang_tp
    options = {"num_cpus": 0, "num_gpus": per_host, "max_concurrency": servers + 4,  # servers start side by side
               **quiet_options()}
    hosts = [ray.remote(ServerHost).options(**options).remote(*([factory] if factory else [])) for _ in range(count)]
    wait_placed(hosts, f"rollout.sglang_gpus_per_host={per_host}", placement_s)
    print(f"megarl: {count} SGLang server host(s) of {servers} server(s): "
          + "; ".join(ray.get([h.where.remote() for h in hosts])), flush=True)
    return [(host, servers, None) for host in hosts]


def wait_placed(hosts: list, what: str, placement_s: float) -> None:
    """Until Ray has placed every server host; past `placement_s`, all of them are ended and the error says so."""
    ready, _ = ray.wait([h.__ray_ready__.remote() for h in hosts], num_returns=len(hosts), timeout=placement_s)
    if len(ready) < len(hosts):
        for host in hosts:
            ray.kill(host)
        raise RuntimeError(f"{what}: Ray placed {len(ready)} of {len(hosts)} SGLang server hosts within "
                           f"{placement_s:.0f} s (the training ranks or other actors hold the GPUs they need?)")


def stop_rollout(rollout, timeout: float = 90.0) -> None:
    """Shut the rollout actor's engine down (its SGLang servers: up to 60 s each), then kill the actor. Should
    the actor be dead or hung, the servers' guards (megarl/rollout/server_guard.py) end them once it is gone."""
    if rollout._actor_id.hex() in _hung_rollouts:  # killed already, for the hang the run stops with
        return
    try:
        ray.get(rollout.shutdown.remote(), timeout=timeout)
    except (ray.exceptions.RayError, TimeoutError) as error:
        print(f"megarl: rollout shutdown failed ({type(error).__name__}: {error}); killing the actor", flush=True)
    finally:
        ray.kill(rollout)
