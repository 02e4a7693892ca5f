"""In-job recovery (trainer.max_restarts): a run that loses a process goes on from its newest checkpoint.

A training rank that dies (SIGKILL, a crash, the OOM killer) or misses trainer.worker_timeout_s (its group kills every
rank then: megarl/workers/group.py), or a rollout actor that dies or hangs, fails the step's call with a WorkerError.
RLTrainer.fit runs each step inside `Recovery.attempt`, which then, up to trainer.max_restarts times in the run:

  ends every training group (its survivors wait for the lost rank in collectives: killed, not asked to stop), and
      in the asynchronous modes the rollout thread (RLTrainer.stop_generating: megarl/async_trainer.py), and starts
      new training groups through Ray, on the resources it gives (the lost rank's node or another);
  replaces the rollout actor where it is the one lost (or, colocated, where the new ranks got other GPUs than its
      servers); a live rollout actor stays up, its engine and servers warm;
  restores the run's newest intact checkpoint (megarl/resume.py picks it as trainer.resume=auto would) through the
      resume path: engines (model, optimizer, LR schedule, RNG), data loader, driver state (the asynchronous modes'
      rollout buffer too), then a verified weight sync into the rollout engine;
  and `Recovery.steps` goes on from the step after that checkpoint, so the steps since are replayed: on the hf engine
      they compute what they computed before, bit for bit (tests/test_recovery.py; one_step_off too:
      tests/test_async_recovery.py).

Each restart is a row of metrics.jsonl at the step resumed from (restart/*: the count, the failed step, the steps
replayed, the seconds lost), a console line naming the cause (the lost processes and the call), and a line of
restarts.jsonl in the run's directory with the cause's text. A fault past the limit stops the run (RestartLimit)
naming it and the earlier ones; so does a fault before the run's first checkpoint, and an error a live rank raised (a
bug or a NaN: a replay would repeat it), at once as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import socket
import time

import ray

from megarl import stops
from megarl.config import Config
from megarl.engine.checkpoint_dir import CHECKPOINT_FILE
from megarl.resume import Start, plan_resume
from megarl.utils.progress import phases
from megarl.workers.placement import PlacementError
from megarl.workers.group import WorkerError, WorkerTimeout, start_rollout

DEATH_NOTICE_S = 5.0  # how long Ray may take to mark a killed process dead after a peer's call failed on it
# how long Ray may take to find a node dead whose raylet no longer answers (its health checks: about 15 s by default)
NODE_NOTICE_S = 120.0


class RestartLimit(WorkerError):
    """A lost process the run does not replace: past trainer.max_restarts, with nothing to restore, or with no room
    left in the Ray cluster for its replacement."""


def dead(handle) -> bool:
    """Whether Ray's actor table has the actor dead (asked of the GCS: a dead or hung actor cannot be asked)."""
    return ray._private.state.actors(handle._actor_id.hex()).get("State") == "DEAD"


def actor_node(handle) -> str | None:
    """The Ray node id of an actor's process, from Ray's actor table (kept after its death)."""
    return ray._private.state.actors(handle._actor_id.hex()).get("Address", {}).get("NodeID")


def dead_nodes() -> dict[str, str]:
    """Ray's dead nodes: node id -> IP address."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if not n["Alive"]}


def silent_nodes(node_ids: set[str]) -> set[str]:
    """The nodes among `node_ids` that Ray still counts alive but whose raylet refuses a connection (or does not
    accept one within 5 s): lost, before Ray's health checks find it."""
    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and n["NodeID"] in node_ids}
    silent = set()
    for node, info in alive.items():
        try:
            socket.create_connection((info["NodeManagerAddress"], info["NodeManagerPort"]), timeout=5).close()
        except OSError:
            silent.add(node)
    return silent


def the_call(error: WorkerError) -> str:
    """The call a WorkerError names (`... failed in train: ...`, `... did not answer train within ...`)."""
    found = re.search(r"(?:failed in|did not answer) ([\w.]+)", str(error))
    return found.group(1) if found else "?"


def training_groups(trainer) -> list:
    """The policy's, the critic's and the reward model's ranks."""
    return [g for g in (trainer.actor, trainer.critic, trainer.reward_model) if g is not None]


class Recovery:
    def __init__(self, trainer, settings: Config | None = None):
        """settings: the config the run was planned with (megarl/resume.py), which its checkpoints store; the
        trainer's own where not given (the asynchronous modes derive their objective from the config as given)."""
        self.trainer, self.settings = trainer, settings or trainer.cfg
        self.limit = trainer.cfg.trainer.max_restarts
        self.first_start = trainer.start  # restored when the run has written no checkpoint of its own yet
        self.work_began = time.time()  # then each restart's end: a later fault throws away only the work after it
        self.restarts: list[dict] = []
        self.resumed: int | None = None  # set by a restart: the step its checkpoint completed

    def steps(self, first: int, last: int):
        """first..last as stops.steps gives them; after a restart, again from the step after the restored one."""
        while True:
            self.resumed = None
            for step in stops.steps(first, last):
                yield step
                if self.resumed is not None:
                    break
            else:
                return
            first = self.resumed + 1

    @contextlib.contextmanager
    def attempt(self, step: int):
        """One step's stages; a lost process inside them is replaced (see the module's docstring)."""
        try:
            yield
        except WorkerError as error:
            lost = self.lost() if self.limit else None
            if not lost:
                raise
            self.resumed = self.restart(error, step, lost)

    def lost(self) -> dict[str, list[str]] | None:
        """The run's lost processes by kind ("training" ranks, "rollout" actor): dead, or killed for a hang, and the
        lost Ray nodes they were on ("nodes"); None when all live (the error came from a live rank)."""
        t, deadline, waited_for_nodes = self.trainer, time.monotonic() + DEATH_NOTICE_S, False
        while True:
            ranks = [(f"{g.role} rank {i} (pid {g.info[i]['pid'] if i < len(g.info) else '?'})",
                      g.info[i].get("node_id") if i < len(g.info) else None)
                     for g in training_groups(t) for i, w in enumerate(g.workers) if g.killed or dead(w)]
            rollout = [("the rollout actor", actor_node(t.rollout))] if dead(t.rollout) else []
            if ranks or rollout:
                gone = dead_nodes()
                nodes = dict.fromkeys(node for _, node in ranks + rollout if node in gone)
                return {"training": [what for what, _ in ranks], "rollout": [what for what, _ in rollout],
                        "nodes": [f"{gone[node]} (node {node})" for node in nodes]}
            if time.monotonic() > deadline:
                # a node whose raylet is gone is found dead by Ray's health checks only, after its peers' calls failed
                if waited_for_nodes or not silent_nodes(self.nodes()):
                    return None
                deadline, waited_for_nodes = time.monotonic() + NODE_NOTICE_S, True
            time.sleep(0.2)

    def nodes(self) -> set[str]:
        """The Ray nodes of the run's training ranks and rollout actor."""
        t = self.trainer
        return {i["node_id"] for g in training_groups(t) for i in g.info if "node_id" in i} | {actor_node(t.rollout)}

    def restart(self, error: WorkerError, step: int, lost: dict[str, list[str]]) -> int:
        """Replace what was lost and restore the newest checkpoint; returns its step."""
        t, detected, began = self.trainer, time.time(), time.perf_counter()
        hang = isinstance(error, WorkerTimeout)
        what = ", ".join(lost["training"] + lost["rollout"])
        with_nodes = f" with the lost Ray node(s) {', '.join(lost['nodes'])}" if lost.get("nodes") else ""
        cause = f"{what} {'missed its deadline' if hang else 'died'}{with_nodes} in {the_call(error)} during step {step}"
        if len(self.restarts) >= self.limit:
            earlier = "; ".join(f"restart {r['restart']}: {r['cause']}" for r in self.restarts)
            raise RestartLimit(f"{cause}, after {len(self.restarts)} restart(s) (trainer.max_restarts={self.limit}): "
                               f"stopping" + (f". Earlier: {earlier}" if earlier else "")) from error
        restore = self.restore_point(cause)
        print(f"megarl: {cause}; restarting from {restore.checkpoint} "
              f"(restart {len(self.restarts) + 1} of at most {self.limit})", flush=True)
        try:
            with phases(f"replacing the lost processes ({what})"):
                self.replace(bool(lost["rollout"]))
        except PlacementError as placement:  # Ray has no room left for them (their node lost): waiting would not help
            raise RestartLimit(f"{cause}; cannot replace them: {placement}; stopping") from placement
        t.start, t.syncs, t.unchecked = restore, 0, None  # the resume's sync is verified, as a run's first
        done = t.resume()
        t.forget_reward_failures_after(done)  # the replayed steps' calls are counted again
        recovery_s = time.perf_counter() - began
        lost_s = detected - max(self.work_began, (restore.checkpoint / CHECKPOINT_FILE).stat().st_mtime)
        self.work_began = time.time()
        record = {"restart": len(self.restarts) + 1, "cause": cause, "call": the_call(error), "lost": what,
                  "failed_step": step, "resumed_from": done, "replayed_steps": step - 1 - done,
                  "lost_s": lost_s, "recovery_s": recovery_s, "seconds_lost": lost_s + recovery_s}
        self.restarts.append(record)
        with open(t.tracker.directory / "restarts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        t.tracker.log({f"restart/{k if k != 'restart' else 'count'}": v for k, v in record.items()
                       if not isinstance(v, str)}, done)
        print(f"megarl: restart {record['restart']} done: resumed after step {done}, replaying {step - 1 - done} "
              f"completed step(s) and step {step}; {lost_s + recovery_s:.1f} s lost ({lost_s:.1f} s of steps since "
              f"the checkpoint, {recovery_s:.1f} s to restart)", flush=True)
        return done

    def restore_point(self, cause: str) -> Start:
        """The run's newest intact checkpoint (as trainer.resume=auto finds it; its settings are this run's), else the
        one the run started from; RestartLimit when there is neither (nothing to replay from)."""
        cfg = self.settings
        own = plan_resume(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="force")))
        start = own if own.checkpoint is not None else self.first_start
        if start.checkpoint is None or start.step == 0:
            raise RestartLimit(f"{cause}, before the run's first checkpoint (trainer.save_every="
                               f"{cfg.trainer.save_every}): nothing to restart from")
        return dataclasses.replace(start, config=self.trainer.start.config, run_id=self.trainer.start.run_id)

    def replace(self, rollout_lost: bool) -> None:
        """New training groups (the asynchronous modes' rollout thread ended first); a new rollout actor where it was
        lost, or where colocated servers would no longer sit on the new ranks' GPUs."""
        t = self.trainer
        before = t.actor.gpus() if t.cfg.sglang_colocated() else None
        for group in training_groups(t):
            group.kill()
            group.shutdown()  # its placement group: the new ranks may take the same resources
        if rollout_lost:  # dead or hung: killed before the rollout thread is ended (its call waiting on it ends)
            ray.kill(t.rollout)
        t.stop_generating(rollout_live=not rollout_lost)  # the asynchronous modes' rollout thread
        t.start_training()
        misplaced = before is not None and t.actor.gpus() != before
        if misplaced and not rollout_lost:
            ray.kill(t.rollout)  # its servers' guards end them
        if rollout_lost or misplaced:
            t.use_rollout(start_rollout(t.cfg, t.model_path, t.device,
                                        t.actor.gpus() if t.cfg.sglang_colocated() else None))
        t.colocation = t.colocate()
