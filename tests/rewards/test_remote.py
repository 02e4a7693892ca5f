import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.config import RewardConfig
from megarl.rewards import build_reward, score
from megarl.rewards.remote import RemoteReward, RemoteRewardError


class RewardServer(BaseHTTPRequestHandler):
    """Scores len(response) / 10; behaviour per request from the response text: 'flaky' fails its first two
    requests with 503, 'slow' sleeps past the client's timeout once, 'bad' gets a 400, 'garbage' invalid JSON."""
    seen: dict = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        response = body["response"]
        count = self.seen[response] = self.seen.get(response, 0) + 1
        if response == "flaky" and count <= 2:
            return self.send_error(503)
        if response == "slow" and count == 1:
            time.sleep(0.6)
        if response == "bad":
            return self.send_error(400)
        payload = b"not json" if response == "garbage" else json.dumps(
            {"reward": len(response) / 10 + (body["answer"] == "bonus")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def url():
    RewardServer.seen = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), RewardServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_remote_reward_answers_and_retries(url):
    reward = build_reward(RewardConfig(name="remote", remote_url=url, remote_timeout_s=0.3, remote_retries=2))
    assert reward("abcd", "x", {"prompt": "p"}) == pytest.approx(0.4)
    assert reward("ab", "bonus", {}) == pytest.approx(1.2)
    assert reward("flaky", "x", {}) == pytest.approx(0.5)   # 503, 503, then 200: third try
    assert RewardServer.seen["flaky"] == 3
    assert reward("slow", "x", {}) == pytest.approx(0.4)    # first request timed out, retried


def test_remote_reward_gives_up(url):
    reward = RemoteReward(url, timeout_s=0.3, retries=1, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="400.*not retried"):
        reward("bad", "x", {})
    assert RewardServer.seen["bad"] == 1
    with pytest.raises(RemoteRewardError, match="invalid JSON"):
        reward("garbage", "x", {})
    with pytest.raises(RemoteRewardError, match="no answer after 2 tries; last error: 503"):
        reward("flaky", "x", {})


def test_unreachable_server_fails_samples_not_the_run(url):
    closed = RemoteReward("http://127.0.0.1:9/score", timeout_s=0.2, retries=1, backoff_s=0.01)
    samples = [{"response": "abc", "answer": "x"}] * 3
    scores = score(samples, closed, timeout_s=5, num_workers=3)
    assert (scores.rewards, scores.failed) == ([0.0] * 3, 3)
    live = RemoteReward(url, timeout_s=0.3, retries=0)
    scores = score(samples + [{"response": "bad", "answer": "x"}], live, num_workers=2)
    assert (scores.rewards, scores.failed) == ([0.3] * 3 + [0.0], 1)


class SilentServer(BaseHTTPRequestHandler):
    """Takes every request and never answers (until the test ends)."""
    requests = 0
    release = threading.Event()

    def do_POST(self):
        SilentServer.requests += 1
        self.release.wait()

    def log_message(self, *args):
        pass


def test_a_server_that_never_answers_is_given_up_on_for_the_rest_of_the_batch():
    SilentServer.requests, SilentServer.release = 0, threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), SilentServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    try:
        reward = build_reward(RewardConfig(name="remote", remote_url=url, remote_timeout_s=0.5, remote_retries=2,
                                           remote_max_timeouts=3))
        samples = [{"response": "abc", "answer": "x"}] * 64
        start = time.monotonic()
        scores = score(samples, reward, timeout_s=30, num_workers=2)
        # one by one at 3 tries x 0.5 s each, 64 samples would wait 48 s (at the defaults, ~2.5 hours)
        assert time.monotonic() - start < 20
        assert (scores.rewards, scores.failed) == ([0.0] * 64, 64)
        assert SilentServer.requests <= 3 + 1  # the third timeout in a row ends the calls (2 were in flight)
        assert re.fullmatch(rf"{url}: \d requests in a row timed out \(reward.remote_max_timeouts=3\); not called "
                            "again in this batch", str(scores.failures[-1].error))
        asked = SilentServer.requests
        assert score(samples[:2], reward, timeout_s=30, num_workers=2).failed == 2
        assert SilentServer.requests > asked  # the next batch tries the server again
    finally:
        SilentServer.release.set()
        server.shutdown()
        server.server_close()
