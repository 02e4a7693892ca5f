"""SGLang's streamed /generate (megarl/rollout/sglang.py StreamedRows, sglang_server.Endpoint.post_stream) against
fake_sglang.py's events, in both of SGLang's streaming modes: each row's tokens are handed over in order as they
come, and the call returns what the unstreamed one does."""

import pytest

from megarl.rollout.base import SamplingParams
from tests.rollout.test_sglang_engine import configure, engine, log


@pytest.mark.parametrize("incremental", [False, True])
def test_a_streamed_generate_hands_over_each_rows_tokens_and_returns_the_whole_answer(tmp_path, incremental):
    e = engine(tmp_path, deterministic=True)  # seeded rows: the same call draws the same tokens again
    try:
        configure(e.servers[0], incremental_streaming_output=incremental)
        prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=5, n=2, seed=3)
        heard: dict[int, list] = {}
        streamed = e.generate(prompts, params, on_tokens=lambda row, offset, ids: heard.setdefault(row, []).append(
            (offset, ids)))
        whole = e.generate(prompts, params)
        first, second = log(e.servers[0], "/generate")
        assert first["body"].get("stream") is True and "stream" not in second["body"]
    finally:
        e.shutdown()
    assert [(g.token_ids, g.logprobs, g.finish_reason) for g in streamed] == \
        [(g.token_ids, g.logprobs, g.finish_reason) for g in whole]
    assert sorted(heard) == [0, 1, 2, 3]
    for row, pieces in heard.items():  # one token at a time, in order, at its place in the response
        assert [offset for offset, _ in pieces] == list(range(5))
        assert [t for _, ids in pieces for t in ids] == streamed[row].token_ids
