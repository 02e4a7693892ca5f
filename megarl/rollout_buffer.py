"""The asynchronous modes' buffer between the rollout thread and the trainer (megarl/async_trainer.py).

The rollout thread produces step-batches (data.prompts_per_step groups, scored) and puts them in as groups; the
trainer takes the groups it trains on in the order they were made. Every row carries the policy version of its
oldest token (`policy_version`), so a group's staleness when it is trained is the trainer's version minus the
oldest of its rows'.

Staleness is bounded twice. Admission (as AReaL's): a rollout batch begins only while its groups, trained after
every group made before them, would be at most async.max_staleness versions older than the trainer's policy by
then; and at most async.buffer_batches batches are ahead of the trainer. Consumption: a group over the bound
(counts shift when groups are dropped, a resumed run may have a smaller bound, over-sampling carries older
groups) is never trained on: dropped, or its prompt goes back to the rollout thread, first in line
(async.stale=regenerate).

One condition variable guards the counters; nobody holds it while waiting on a worker, and a weight update
never needs it (the rollout engine pauses itself: megarl/rollout/partial.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from megarl.protocol import IMAGE_INPUTS, REWARD_FIELDS, Batch


@dataclass
class Group:
    batch: Batch  # one prompt's samples, scored
    batch_number: int  # the rollout batch it came from (1-based, in the order batches began)
    metrics: dict  # that batch's rollout metrics (shared by its groups)

    def version(self) -> int:
        """The policy version of the group's oldest token."""
        return int(self.batch["policy_version"].min())


@dataclass
class Taken:
    """What the trainer took for a step."""
    groups: list[Group]
    waited_s: float
    dropped: int  # groups over the bound, skipped
    regenerated: int  # groups over the bound whose prompts went back to the rollout thread
    ready: int  # groups left in the buffer


def split_groups(batch: Batch) -> list[Batch]:
    """The batch's groups (rows sharing a `group`), in the order of their first rows."""
    rows: dict = {}
    for row, group in enumerate(batch["group"]):
        rows.setdefault(group, []).append(row)
    return [batch.index(r) for r in rows.values()]


def prompt_record(group: Batch) -> dict:
    """A group's prompt as the data loader gives it (prompt_ids, prompt, answer, the row's REWARD_FIELDS and a
    vision-language prompt's images), from its first row: the tokens before the first model token."""
    model_tokens = group["loss_mask"][0].nonzero()
    length = int(model_tokens[0]) if len(model_tokens) else int(group["attention_mask"][0].sum())
    kept = {k: group[k][0] for k in IMAGE_INPUTS + REWARD_FIELDS if k in group}
    return {"prompt_ids": group["tokens"][0, :length].tolist(), "prompt": group["prompt"][0],
            "answer": group["answer"][0]} | kept


class RolloutBuffer:
    def __init__(self, groups_per_step: int, max_staleness: int, buffer_batches: int, stale: str, steps: int):
        self.per_step, self.max_staleness, self.stale, self.steps = groups_per_step, max_staleness, stale, steps
        self.buffer_batches = buffer_batches or max_staleness + 1
        self.cond = threading.Condition()
        self.ready: deque[Group] = deque()
        self.requeued: list[dict] = []  # prompts to generate again (async.stale=regenerate), first in line
        self.begun = 0  # rollout batches begun
        self.finished = 0  # rollout batches put in
        self.accepted = 0  # groups the trainer took to train on (including a take still waiting for more)
        self.consumed = 0  # groups taken off the buffer: accepted, dropped or requeued
        self.published = 0  # the policy version the rollout engine holds
        self.paused = False  # a checkpoint is being written: no batch begins
        self.closed = False
        self.error: BaseException | None = None

    # ---- the rollout thread ---------------------------------------------------------------------------

    def groups_ahead(self) -> int:
        """Groups made or being made, not taken yet."""
        return self.begun * self.per_step - self.consumed

    def trained_at(self) -> int:
        """The version the next rollout batch's groups would be trained at (at the latest: a group before them dropped
        at the take moves them to an earlier step)."""
        return (self.accepted + self.groups_ahead()) // self.per_step

    def admits(self) -> bool:
        """Whether the next rollout batch may begin now (module docstring): it is needed (the groups made or
        being made do not cover the run's steps), its first group would be trained within max_staleness
        versions of the policy the rollout holds now, and the buffer has room for it."""
        ahead = self.groups_ahead()
        return (self.accepted + ahead < self.steps * self.per_step
                and self.trained_at() - self.published <= self.max_staleness
                and ahead + self.per_step <= self.buffer_batches * self.per_step)

    def begin_batches(self, most: int = 1) -> tuple[list[tuple[int, int]], int, float] | None:
        """Wait until a batch may begin, then begin as many as admits() allows now, at most `most` (0: the buffer's
        bound only; async.batches_at_once: generated in one engine call). ([(each one's number, the version its groups
        would be trained at: trained_at())], the policy version the rollout holds, seconds waited), or None once the
        buffer is closed. Every batch begun is admitted as if begun alone, one after the other, from the version the
        rollout holds now: all of them are generated from it or a newer one, so each keeps its own bound."""
        start = time.perf_counter()
        with self.cond:
            self.cond.wait_for(lambda: self.closed or (not self.paused and self.admits()))
            if self.closed:
                return None
            begun = []
            while (not most or len(begun) < most) and self.admits():
                begun.append((self.begun + 1, self.trained_at()))
                self.begun += 1
            return begun, self.published, time.perf_counter() - start

    def put_batch(self, number: int, batch: Batch, metrics: dict) -> None:
        """Batch `number`'s groups, ready (batches begun together are put in the order they began)."""
        with self.cond:
            self.ready.extend(Group(group, number, metrics) for group in split_groups(batch))
            self.finished += 1
            self.cond.notify_all()

    def requeue(self, prompts: list[dict]) -> None:
        """Prompts to generate again, first in line (async.stale=regenerate)."""
        with self.cond:
            self.requeued += prompts

    def take_requeued(self, size: int) -> list[dict]:
        """Up to `size` prompts to generate again."""
        with self.cond:
            taken, self.requeued = self.requeued[:size], self.requeued[size:]
            return taken

    def fail(self, error: BaseException) -> None:
        """The rollout thread stopped on an error: the trainer raises it at its next take."""
        with self.cond:
            self.error = error
            self.cond.notify_all()

    # ---- the trainer ----------------------------------------------------------------------------------

    def take(self, version: int) -> Taken:
        """data.prompts_per_step groups for the step trained at policy `version`, oldest first; groups more
        than max_staleness versions old are dropped or requeued on the way. Waits for them (raises the error the
        rollout thread stopped on, if it did)."""
        start, groups, dropped, regenerated = time.perf_counter(), [], 0, 0
        with self.cond:
            while len(groups) < self.per_step:
                self.cond.wait_for(lambda: self.ready or self.error is not None or self.closed)
                if self.error is not None:  # its own error (e.g. RewardFailureError), its traceback the thread's
                    raise self.error
                if self.closed:
                    raise RuntimeError("the rollout buffer was closed while the trainer waited for samples")
                group = self.ready.popleft()
                self.consumed += 1
                if version - group.version() > self.max_staleness:
                    if self.stale == "regenerate":
                        self.requeued.append(prompt_record(group.batch))
                        regenerated += 1
                    else:
                        dropped += 1
                else:
                    groups.append(group)
                    self.accepted += 1
                self.cond.notify_all()  # a consumed group may admit the next rollout batch
            return Taken(groups, time.perf_counter() - start, dropped, regenerated, len(self.ready))

    def publish(self, version: int) -> None:
        """The rollout engine holds policy `version` now."""
        with self.cond:
            self.published = version
            self.cond.notify_all()

    def wait_finished(self, number: int) -> None:
        """Until rollout batch `number` is in (or the rollout thread stopped)."""
        with self.cond:
            self.cond.wait_for(lambda: self.finished >= number or self.error is not None or self.closed)

    @contextmanager
    def paused_between_batches(self) -> Iterator[None]:
        """No rollout batch in the making for the duration (the one in the making first finishes): the prompts
        drawn and the buffer's contents agree, for a checkpoint. Raises the error the rollout thread stopped on, if
        it did: its batch begun and never put in, the buffer's state would count groups that will never come."""
        with self.cond:
            self.paused = True
            self.cond.wait_for(lambda: self.finished == self.begun or self.error is not None)
            error = self.error
        try:
            if error is not None:
                raise error
            yield
        finally:
            with self.cond:
                self.paused = False
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # ---- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The groups waiting (with their versions and rollout metrics), the prompts requeued and the counters
        (call it while paused_between_batches)."""
        with self.cond:
            return {"groups": [(g.batch, g.batch_number, g.metrics) for g in self.ready],
                    "requeued": list(self.requeued), "begun": self.begun, "accepted": self.accepted,
                    "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        with self.cond:
            shared: dict[int, dict] = {}  # one metrics dict per rollout batch again
            self.ready = deque(Group(batch, number, shared.setdefault(number, metrics))
                               for batch, number, metrics in state["groups"])
            self.requeued = list(state["requeued"])
            self.begun = self.finished = state["begun"]
            self.accepted, self.consumed = state["accepted"], state["consumed"]

    def start_at(self, steps_done: int) -> None:
        """A run resumed after `steps_done` steps from a checkpoint without a buffer (written in sync mode): the
        rollout begins with the next step's batch."""
        with self.cond:
            self.begun = self.finished = steps_done
            self.accepted = self.consumed = steps_done * self.per_step


def staleness_metrics(batch: Batch, version: int, max_staleness: int) -> dict:
    """The bound checked on every row the trainer is about to train on (an AssertionError names the rows over it,
    which admission and the take should have made impossible), and the step's staleness histogram."""
    staleness = version - batch["policy_version"]
    over = (staleness > max_staleness).nonzero().flatten().tolist()
    if over or (staleness < 0).any():
        raise AssertionError(f"rows {over} are over async.max_staleness={max_staleness} (or from a future policy) at "
                             f"trainer version {version}: policy versions {batch['policy_version'].tolist()}")
    counts = torch.bincount(staleness, minlength=max_staleness + 1).tolist()
    return {f"async/staleness_{k}": float(n) for k, n in enumerate(counts)} | {
        "async/staleness_mean": staleness.float().mean().item(), "async/staleness_max": float(staleness.max())}
