"""A reward computed by a server over HTTP: one JSON POST per sample.

Request body: `{"prompt": ..., "response": ..., "answer": ...}`. The server answers 200 with either
`{"reward": <number>}` or a bare number.

Each request has its own timeout. A connection error, a timeout, a 5xx or a 429 answer is retried up
to `retries` times, waiting backoff_s, 2*backoff_s, 4*backoff_s ... in between; any other 4xx means
the request itself is wrong and is not retried. When the tries run out the call raises, and `score`
counts the sample as failed. Keep reward.timeout_s above the worst case, (retries + 1) * timeout_s plus
the backoff, or score's limit cuts the retries short. Use reward.num_workers > 1 to have several
requests in flight.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

from megarl.rewards import REWARD_BUILDERS

RETRYABLE_STATUS = {429, 500, 502, 503, 504}


class RemoteRewardError(RuntimeError):
    """The reward server gave no usable answer."""


class RemoteReward:
    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward URL {url!r} must start with http:// or https://")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    def __call__(self, response: str, answer: str, sample: dict) -> float:
        body = json.dumps({"prompt": sample.get("prompt", ""), "response": response, "answer": answer}).encode()
        last_error = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    return self._parse(reply.read())
            except urllib.error.HTTPError as e:
                if e.code not in RETRYABLE_STATUS:
                    raise RemoteRewardError(f"{self.url} answered {e.code} {e.reason} (not retried)") from None
                last_error = f"{e.code} {e.reason}"
            except (urllib.error.URLError, socket.timeout, ConnectionError) as e:
                last_error = repr(getattr(e, "reason", e))
        raise RemoteRewardError(f"{self.url}: no answer after {self.retries + 1} tries; last error: {last_error}")

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
    return RemoteReward(cfg.remote_url, timeout_s=cfg.remote_timeout_s, retries=cfg.remote_retries)
