"""The user's agents, run against the gateway (megarl/rollout/gateway.py) during a rollout.

An agent is a plain function `agent(base_url, api_key, row) -> float | None` (agent.gateway.function,
`package.module:function` or `file.py:function`): it talks to the policy through any OpenAI client at `base_url` with
`api_key`, which names this one run, and returns its reward, or None for megarl's reward (reward.name) to score the
run's last answer. `row` is the prompt row (prompt, answer, data_source, extra_info ...; no token ids). Or it is a
command (agent.gateway.command), run per sample with the same three things (gateway_command.py).

Each sample of a prompt is one run, in a thread of its own, at most agent.gateway.max_concurrent at once. A run that
raises (a command: exits non-zero), returns something other than a finite number or None, or is still running
agent.gateway.timeout_s after it began is dropped: its key is revoked (its later requests get HTTP 401), its record
discarded, and it is counted. A hanging function's thread cannot be stopped from outside; it is left to end by itself,
as a hanging tool's is (a hanging command is killed with its process group). A run that never had the model generate is
dropped too (nothing to train on).

What a run recorded becomes rows of its prompt's group: one per segment that holds model tokens (gateway_record.py),
each with the run's reward. `run_groups` has the agent loop's interface (megarl/rollout/agent.py), so the rollout
worker, the synchronous Sampler and the asynchronous modes' streaming of groups take it unchanged.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from typing import Callable

from megarl.config import AgentConfig
from megarl.protocol import Batch
from megarl.rollout.agent import Trajectory
from megarl.rollout.base import RolloutEngine, SamplingParams
from megarl.rollout.gateway import Gateway
from megarl.rollout.gateway_command import CommandAgent
from megarl.rollout.gateway_record import Record
from megarl.utils.registry import Registry

log = logging.getLogger(__name__)
AGENTS = Registry("agent")  # no built-in ones: agents are the user's `module:function`

# what take_counts() reports (each reset when read)
COUNTS = ("agents", "agents_crashed", "agents_timed_out", "agents_empty", "requests", "segments", "segments_edited")


class GatewayAgents:
    def __init__(self, engine: RolloutEngine, tokenizer, config: AgentConfig, model_name: str = "megarl"):
        self.config = config
        self.fn = AGENTS.get(config.gateway.function) if config.gateway.function else \
            CommandAgent(config.gateway.command, config.gateway.timeout_s)
        self.gateway = Gateway(engine, tokenizer, config, model_name)
        self.tokenizer = tokenizer
        self.counts: Counter = Counter()
        self.lock = threading.Lock()

    def run_groups(self, groups: list[list[Trajectory]], params: SamplingParams, needed: int | None = None,
                   accept: Callable[[list[Trajectory]], bool] | None = None,
                   on_group: Callable[[int, list[Trajectory]], None] | None = None,
                   images: list | None = None, rows: list[dict] | None = None):
        """One agent run per conversation of `groups` (its prompt's row: rows[Trajectory.prompt_index]); each group
        handed to `on_group(i, its rows)` once its runs have all ended. Returns (the groups with rows, in order, each
        its kept runs' segments; [] unfinished; 0 rejected), as AgentLoop.run_groups."""
        if needed is not None or accept is not None:
            raise ValueError("gateway agents run to their end: over-sampling cannot abort them")
        if images and any(i is not None for i in images):
            raise ValueError("the gateway takes text only: these prompts have images")
        self.gateway.begin(params)
        jobs = [(i, t) for i, group in enumerate(groups) for t in group]
        left = Counter(i for i, _ in jobs)
        kept: dict[int, dict[int, list[Trajectory]]] = {i: {} for i in range(len(groups))}  # group -> job -> rows
        done: queue.Queue = queue.Queue()
        running: dict[int, tuple[Record, float]] = {}  # job -> its record, its deadline
        timeout, slots, start = self.config.gateway.timeout_s, self.config.gateway.max_concurrent, 0

        def end(job: int, outcome: list[Trajectory] | None) -> None:
            group = jobs[job][0]
            record, _ = running.pop(job)
            self.gateway.close_record(record)
            if outcome:
                kept[group][job] = outcome
            left[group] -= 1
            if not left[group] and kept[group] and on_group is not None:
                on_group(group, rows_of(group))

        def rows_of(group: int) -> list[Trajectory]:  # in the order of its runs, whichever ended first
            return [t for job in sorted(kept[group]) for t in kept[group][job]]

        while start < len(jobs) or running:
            while start < len(jobs) and len(running) < slots:
                group, t = jobs[start]
                record = self.gateway.open(t.prompt_index, t.policy_version)
                row = {k: v for k, v in (rows[t.prompt_index] if rows else {}).items() if k != "prompt_ids"}
                running[start] = (record, time.monotonic() + timeout)
                threading.Thread(target=self._run, args=(start, record, row, done), daemon=True,
                                 name=f"megarl-agent-{start}").start()
                start += 1
            wait = max(0.0, min(deadline for _, deadline in running.values()) - time.monotonic())
            try:
                job, reward, error = done.get(timeout=wait)
            except queue.Empty:
                now = time.monotonic()
                for job in [j for j, (_, deadline) in running.items() if deadline <= now]:
                    self._count("agents_timed_out", running[job][0])
                    end(job, None)
                continue
            if job not in running:  # it timed out before it returned
                continue
            record = running[job][0]
            if error is not None:
                self._count("agents_crashed", record, error)
                end(job, None)
            elif not record.segments or not any(any(s.trajectory.loss_mask) for s in record.segments):
                self._count("agents_empty", record)
                end(job, None)
            else:
                self._count(None, record)
                end(job, record.trajectories(reward))
        return [rows_of(i) for i in range(len(groups)) if kept[i]], [], 0

    def _run(self, job: int, record: Record, row: dict, done: queue.Queue) -> None:
        try:
            reward = self.fn(self.gateway.base_url, record.key, row)
            if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                       or not math.isfinite(reward)):
                raise TypeError(f"the agent returned {reward!r}: a finite number or None")
            done.put((job, None if reward is None else float(reward), None))
        except BaseException as e:  # noqa: B036  (an agent's failure drops its run, never the rollout)
            done.put((job, None, f"{type(e).__name__}: {e}"))

    def _count(self, outcome: str | None, record: Record, error: str | None = None) -> None:
        with self.lock:
            self.counts["agents"] += 1
            if outcome is not None:
                self.counts[outcome] += 1
            self.counts["requests"] += record.requests
            if outcome is None:
                self.counts["segments"] += len(record.segments)
                self.counts["segments_edited"] += sum(s.trajectory.origin["new_segment"] == "edited"
                                                      for s in record.segments)
        if error is not None:
            log.warning("agent run dropped: %s", error)

    def take_counts(self) -> dict:
        """The COUNTS since the last call."""
        with self.lock:
            counts, self.counts = self.counts, Counter()
        return {k: counts[k] for k in COUNTS}

    def close(self) -> None:
        if isinstance(self.fn, CommandAgent):
            self.fn.close()
        self.gateway.close()


def final_segments(batch: Batch) -> Batch:
    """Each run's last segment (the row holding its final answer), for held-out scores, of the prompts none of whose
    runs was dropped (so every prompt has its k runs, as megarl.data.evaluation reads them)."""
    last = {summary["agent"]: row for row, summary in enumerate(batch["trajectory"])}
    rows = sorted(last.values())
    sizes = Counter(batch["group"][row] for row in rows)
    return batch.index([row for row in rows if sizes[batch["group"][row]] == max(sizes.values())])
