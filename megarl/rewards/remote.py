"""A reward computed by a server over HTTP: one JSON POST per sample.

Request body: `{"prompt": ..., "response": ..., "answer": ...}`. The server answers 200 with either
`{"reward": <number>}` or a bare number.

Each request has its own timeout. A connection error, a timeout, a 5xx or a 429 answer is retried up
to `retries` times, waiting backoff_s, 2*backoff_s, 4*backoff_s ... in between; any other 4xx means
the request itself is wrong and is not retried. When the tries run out the call raises, and `score`
counts the sample as failed. Keep reward.timeout_s above the worst case, (retries + 1) * timeout_s plus
the backoff, or score's limit cuts the retries short. Use reward.num_workers > 1 to have several
requests in flight.

A server that never answers would cost timeout_s per try of every sample (hours for one step): once
`max_timeouts` requests in a row have timed out, the reward calls the server no more in this batch; the
batch's remaining samples fail at once, naming the server, and the next batch (`score` calls `run_calls`
once per batch) tries it again. reward.batch_timeout_s bounds the batch's wait in any case.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

from megarl.rewards import REWARD_BUILDERS
from megarl.rewards.scoring import call_reward, run_threads

RETRYABLE_STATUS = {429, 500, 502, 503, 504}


class RemoteRewardError(RuntimeError):
    """The reward server gave no usable answer."""


class RemoteReward:
    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5,
                 max_timeouts: int = 3):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward URL {url!r} must start with http:// or https://")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.max_timeouts = max_timeouts
        self.timeouts_in_a_row = 0  # of this batch's requests
        self.lock = threading.Lock()

    def run_calls(self, samples: list[dict], timeout_s: float | None, num_workers: int,
                  deadline: float | None) -> list:
        """One batch (`score` calls this): the server gets a fresh chance, then up to num_workers requests at once."""
        with self.lock:
            self.timeouts_in_a_row = 0
        return run_threads(samples, lambda sample: call_reward(self, sample), timeout_s, num_workers, deadline)

    def __call__(self, response: str, answer: str, sample: dict) -> float:
        body = json.dumps({"prompt": sample.get("prompt", ""), "response": response, "answer": answer}).encode()
        last_error = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            if self.timeouts_in_a_row >= self.max_timeouts:
                raise RemoteRewardError(f"{self.url}: {self.timeouts_in_a_row} requests in a row timed out "
                                        f"(reward.remote_max_timeouts={self.max_timeouts}); not called again in "
                                        "this batch")
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    raw = reply.read()
                self._count(timed_out=False)
                return self._parse(raw)
            except urllib.error.HTTPError as e:
                self._count(timed_out=False)
                if e.code not in RETRYABLE_STATUS:
                    raise RemoteRewardError(f"{self.url} answered {e.code} {e.reason} (not retried)") from None
                last_error = f"{e.code} {e.reason}"
            except (urllib.error.URLError, socket.timeout, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                timed_out = isinstance(reason, socket.timeout)  # connecting, or waiting for the answer
                self._count(timed_out)
                last_error = repr(reason)
        raise RemoteRewardError(f"{self.url}: no answer after {self.retries + 1} tries; last error: {last_error}")

    def _count(self, timed_out: bool) -> None:
        with self.lock:
            self.timeouts_in_a_row = self.timeouts_in_a_row + 1 if timed_out else 0

    def _parse(self, raw: bytes) -> float:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            raise RemoteRewardError(f"{self.url} answered with invalid JSON: {raw[:200]!r}") from None
        value = data.get("reward") if isinstance(data, dict) else data
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RemoteRewardError(f"{self.url} answered {raw[:200]!r}; expected {{\"reward\": <number>}} or a number")
        return float(value)


@REWARD_BUILDERS.register("remote")
def build_remote_reward(cfg) -> RemoteReward:
    return RemoteReward(cfg.remote_url, timeout_s=cfg.remote_timeout_s, retries=cfg.remote_retries,
                        max_timeouts=cfg.remote_max_timeouts)
