"""Partial rollouts: generation stopped at a weight update and continued under the new weights.

Both engines run a generate() call as segments through `generate_rows`: each segment is one request to the
engine (prompt plus the tokens the row has so far, what is left of its token budget, its own sampling seed)
and runs between two weight updates, under one policy version. A `GenerationGate` sits in front of the
segments: `pause` (before a weight update) stops new segments from starting and, for partial=resume or
restart, interrupts the running ones (SGLang: /abort_request, which answers with the tokens and log-probs
produced so far; hf: a stop flag checked between decode steps); it returns once no segment runs, so the
update never waits on a lock a generation holds. `resume(version)` (after the update) lets them go on:

- resume: an interrupted row continues from its tokens (a re-submitted prompt + tokens, the budget reduced);
  its tokens keep the versions that produced them. With a seeded sampler whose draws follow from the row's seed
  and the token's position (SGLang's deterministic sampler, the hf engine's), the draws continue exactly.
- restart: an interrupted row starts again from its prompt; its tokens are dropped.
- finish: nothing is interrupted; the pause waits for the running segments to end.

Bounds (partial rollouts that never finish): a row never gets more than its token budget in total, and a row
interrupted more than `max_interruptions` times ends there with finish_reason "abort" (its tokens so far), so a
generate() call returns after at most that many weight updates. `cancel()` (over-sampling's abort) ends the
running segments' rows with "abort" for good.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megarl.rollout.base import Generation, ImageInputs

PARTIAL_MODES = ("resume", "restart", "finish")


@dataclass
class Segment:
    """What a segment started under: the policy version (None: never told) and the gate's counters."""
    version: int | None
    pauses: int
    cancels: int


class GenerationGate:
    """Pause and resume of an engine's generation around weight updates (thread-safe)."""

    def __init__(self, poll_s: float = 0.05):
        self._cond = threading.Condition()
        self.poll_s = poll_s  # how often a pause re-sends the abort while segments are still running
        self.paused = False
        self.modes: dict[int, str] = {}  # interrupting pause number -> its partial mode (resume / restart)
        self.version: int | None = None  # the policy version the engine holds, once told (resume)
        self.running = 0  # segments running
        self.running_rows = 0  # their rows
        self.pauses = 0  # pauses that interrupted (resume / restart)
        self.cancels = 0
        self.stop = threading.Event()  # set while running segments should stop (engines that poll it: hf)

    def enter(self, rows: int) -> Segment:
        """Wait while paused, then count a running segment of `rows` rows."""
        with self._cond:
            self._cond.wait_for(lambda: not self.paused)
            self.running += 1
            self.running_rows += rows
            return Segment(self.version, self.pauses, self.cancels)

    def leave(self, rows: int) -> None:
        with self._cond:
            self.running -= 1
            self.running_rows -= rows
            self._cond.notify_all()

    def outcome(self, segment: Segment) -> str | None:
        """Why a segment's rows that ended "abort" did: "cancel", "resume" or "restart" (interrupted by a pause
        with that mode: the first pause after the segment started), or None (the engine aborted them itself)."""
        with self._cond:
            if self.cancels != segment.cancels:
                return "cancel"
            return self.modes.get(segment.pauses + 1) if self.pauses != segment.pauses else None

    def stopping(self, segment: Segment) -> bool:
        """Whether a running segment should stop now (polled between decode steps)."""
        return self.stop.is_set() or self.cancels != segment.cancels

    def pause(self, partial: str, abort: Callable[[], None] | None) -> dict:
        """Hold new segments; with partial resume/restart interrupt the running ones (`abort` asks the engine,
        again every poll_s while some still run: a request may reach a server just after an abort). Returns once
        none runs. A second pause before resume does nothing."""
        if partial not in PARTIAL_MODES:
            raise ValueError(f"partial={partial!r}: expected one of {', '.join(PARTIAL_MODES)}")
        start = time.perf_counter()
        with self._cond:
            if self.paused:
                return {}
            self.paused = True
            interrupting = partial != "finish" and self.running > 0
            if interrupting:
                self.pauses += 1
                self.modes = {n: m for n, m in self.modes.items() if n > self.pauses - 64} | {self.pauses: partial}
                self.stop.set()
            interrupted = self.running_rows if interrupting else 0
        while True:
            if interrupting and abort is not None:
                abort()
            with self._cond:
                if self._cond.wait_for(lambda: self.running == 0, timeout=self.poll_s):
                    break
        return {"rollout/interrupted_rows": interrupted, "rollout/pause_s": time.perf_counter() - start}

    def resume(self, version: int) -> None:
        with self._cond:
            self.version, self.paused = version, False
            self.stop.clear()
            self._cond.notify_all()

    def cancel(self) -> None:
        """The running segments end (over-sampling's abort): their rows are not continued."""
        with self._cond:
            self.cancels += 1

    def idle(self) -> bool:
        """No segment runs, or generation is paused (weights may change)."""
        with self._cond:
            return self.running == 0 or self.paused


@dataclass
class Row:
    """One response being generated, across segments."""
    prompt: list[int]
    budget: int  # max_new_tokens over all its segments
    seed: int | None = None  # its own sampling seed, the same in every segment
    images: ImageInputs | None = None  # its prompt's images (a vision-language policy), in every segment
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list = field(default_factory=list)  # per token, the policy version that produced it (None: not told)
    interruptions: int = 0
    finish_reason: str = ""
    # the last segment's record of the experts (Generation.routed_experts): its prefill re-routed every earlier token
    routed_experts: torch.Tensor | None = None

    def generation(self, prompt_index: int) -> Generation:
        return Generation(prompt_index, self.token_ids, self.logprobs, self.finish_reason,
                          versions=None if None in self.versions else self.versions,
                          interruptions=self.interruptions, routed_experts=self.routed_experts)


# run(prompts, max_new_tokens per row, seeds per row, segment) -> one Generation per row; "abort" where stopped.
# Where any row has images, run also gets images= (one ImageInputs or None per row); where the caller listens for
# rows' ends (generate_rows' on_finished), ended= (a function of a row's index in the segment and its Generation), which
# a runner that sees a row end before the segment returns (a stop token, its budget) may call then. Where the caller
# listens for tokens (generate_rows' on_tokens), produced= (a function of a row's index in the segment, the position in
# the segment's output where the tokens begin, and the token ids it has just produced), which the runner calls as it
# produces them (a request retried on another server reports its tokens again from position 0).
SegmentRunner = Callable[..., list[Generation]]


def generate_rows(rows: list[Row], gate: GenerationGate, run: SegmentRunner, max_interruptions: int,
                  on_finished: Callable[[int, Row], None] | None = None,
                  on_tokens: Callable[[int, int, list[int]], None] | None = None) -> list[Row]:
    """Generate every row to its end through segments (module docstring); returns `rows`, finished.
    `on_finished(i, rows[i])`, once per row, as soon as the row has ended for good (from this thread, maybe while its
    segment still runs: a group of rows can be scored while the others generate).
    `on_tokens(i, offset, token_ids)`: row i has just produced `token_ids`, at `offset` in its response, from the
    runner's thread; an offset below what row i reported before means its later tokens were dropped (a restart)."""
    pending = [i for i, r in enumerate(rows) if not r.finish_reason]
    while pending:
        segment = gate.enter(len(pending))
        images, reported = [rows[i].images for i in pending], set()
        extra = {"images": images} if any(i is not None for i in images) else {}
        if on_finished is not None:
            def ended(k: int, out: Generation, segment=segment, pending=pending, reported=reported) -> None:
                row = rows[pending[k]]
                extend(row, out, segment.version)
                row.finish_reason = out.finish_reason
                reported.add(k)
                on_finished(pending[k], row)
            extra["ended"] = ended
        if on_tokens is not None:
            def produced(k: int, start: int, token_ids: list[int], pending=pending,
                         offsets=[len(rows[i].token_ids) for i in pending]) -> None:
                on_tokens(pending[k], offsets[k] + start, token_ids)
            extra["produced"] = produced
        try:
            outputs = run([rows[i].prompt + rows[i].token_ids for i in pending],
                          [rows[i].budget - len(rows[i].token_ids) for i in pending],
                          [rows[i].seed for i in pending], segment, **extra)
        finally:
            gate.leave(len(pending))
        if len(outputs) != len(pending):
            raise RuntimeError(f"a generation segment returned {len(outputs)} outputs for {len(pending)} rows")
        cause = gate.outcome(segment)
        still = []
        for k, (i, out) in enumerate(zip(pending, outputs)):
            if k in reported:
                continue
            row = rows[i]
            extend(row, out, segment.version)
            if out.finish_reason != "abort":
                row.finish_reason = out.finish_reason
            elif cause not in ("resume", "restart") or row.interruptions >= max_interruptions:
                row.finish_reason = "abort"  # cancelled, aborted by the engine itself, or over the bound
                row.interruptions += cause in ("resume", "restart")
            elif len(row.token_ids) >= row.budget:  # interrupted just as its budget ran out
                row.finish_reason = "length"
            else:
                row.interruptions += 1
                if cause == "restart":
                    row.token_ids, row.logprobs, row.versions, row.routed_experts = [], [], [], None
                still.append(i)
                continue
            if on_finished is not None:
                on_finished(i, row)
        pending = still
    return rows


def extend(row: Row, out: Generation, version: int | None) -> None:
    """A segment's tokens onto its row, each stamped with the segment's policy version."""
    row.token_ids += out.token_ids
    row.logprobs += out.logprobs
    row.versions += [version] * len(out.token_ids)
    if out.routed_experts is not None:
        row.routed_experts = out.routed_experts
