"""rollout.top_k in the transformers engine's sampler: the k most likely tokens, then top_p over what they keep."""

import torch

from megarl.rollout.hf import _sample

ROWS, VOCAB = 16, 40


def logits(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def draws(x: torch.Tensor, steps: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """[steps, rows] tokens, each step a position of its own (so its own uniform draw per row)."""
    seeds = list(range(ROWS))
    return torch.stack([_sample(x, temperature, top_p, seeds, [step] * ROWS, top_k=top_k) for step in range(steps)])


def test_top_k_1_is_greedy_at_any_temperature():
    x = logits()
    for temperature, top_p in ((0.5, 1.0), (1.0, 1.0), (3.0, 1.0), (1.0, 0.8)):
        assert torch.equal(draws(x, 20, temperature, top_p, top_k=1), x.argmax(-1).expand(20, ROWS))


def test_top_k_never_draws_outside_the_k_most_likely():
    x, k = logits(1, scale=0.3), 5  # a flat distribution: without top_k most draws fall outside the top 5
    top = x.topk(k, -1).indices  # [rows, k]
    inside = lambda tokens: (tokens.T[:, :, None] == top[:, None, :]).any(-1)  # noqa: E731  [rows, steps]
    cut = draws(x, 300, top_k=k)
    assert inside(cut).all()
    assert all(len(set(row.tolist())) == k for row in cut.T)  # each of the k is drawn, not just the argmax
    assert not inside(draws(x, 300)).all()  # the same draws without top_k leave the top 5
    assert not inside(draws(x, 300, temperature=2.0, top_k=VOCAB)).all()  # k = the vocabulary: no cut


def test_top_k_off_and_top_p_after_top_k():
    x = logits(2)
    plain = draws(x, 50)
    assert torch.equal(draws(x, 50, top_k=-1), plain) and torch.equal(draws(x, 50, top_k=0), plain)
    # top_p applies to the renormalized top-k distribution (SGLang's order): with k=2 and top_p just above the
    # larger share, the second token is cut too
    two = x.topk(2, -1)
    share = torch.softmax(two.values, -1)[:, 0]  # the most likely token's probability among the two
    greedy = draws(x, 50, top_p=float(share.min()) - 1e-4, top_k=2)
    assert torch.equal(greedy, x.argmax(-1).expand(50, ROWS))
