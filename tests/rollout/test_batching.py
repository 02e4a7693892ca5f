import pytest
import torch
from transformers import AutoTokenizer

from megarl.models.tiny import build_tiny_model
from megarl.rollout.base import Generation
from megarl.rollout.batching import generations_to_batch


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_layout_puts_response_at_exactly_the_generated_positions(tok):
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompts = [{"prompt": "abc>", "prompt_ids": ids(tok, "abc>"), "answer": "cba"},
               {"prompt": "z>", "prompt_ids": ids(tok, "z>"), "answer": "z"}]
    gens = [Generation(0, ids(tok, "cb") + [eos], [-0.1, -0.2, -0.3], "stop"),
            Generation(0, ids(tok, "cbaxy"), [-1.0, -2.0, -3.0, -4.0, -5.0], "length"),
            Generation(1, ids(tok, "z") + [eos], [-0.5, -0.6], "stop")]
    batch = generations_to_batch(prompts, gens, pad, policy_version=7, tokenizer=tok)

    assert batch["tokens"].tolist() == [ids(tok, "abc>cb") + [eos] + [pad] * 2,
                                        ids(tok, "abc>cbaxy"),
                                        ids(tok, "z>z") + [eos] + [pad] * 5]
    assert batch["attention_mask"].tolist() == [[1] * 7 + [0] * 2, [1] * 9, [1] * 4 + [0] * 5]
    assert batch["loss_mask"].tolist() == [[0] * 4 + [1] * 3 + [0] * 2, [0] * 4 + [1] * 5, [0, 0, 1, 1] + [0] * 5]
    expected_lp = torch.tensor([[0, 0, 0, 0, -0.1, -0.2, -0.3, 0, 0],
                                [0, 0, 0, 0, -1.0, -2.0, -3.0, -4.0, -5.0],
                                [0, 0, -0.5, -0.6, 0, 0, 0, 0, 0]])
    assert torch.equal(batch["rollout_logprobs"], expected_lp)
    assert batch["policy_version"].tolist() == [7, 7, 7] and batch["policy_version"].dtype == torch.long
    assert batch["group"] == [0, 0, 1]
    assert batch["prompt"] == ["abc>", "abc>", "z>"] and batch["answer"] == ["cba", "cba", "z"]
    assert batch["response"] == ["cb", "cbaxy", "z"]  # decoded without the stop token


def test_a_custom_stop_token_is_not_part_of_the_response_text(tok):
    prompts = [{"prompt": "q", "prompt_ids": ids(tok, "q"), "answer": "a"}]
    gens = [Generation(0, ids(tok, "ab."), [-1.0, -1.0, -1.0], "stop")]
    assert generations_to_batch(prompts, gens, tok.pad_token_id, 0, tok)["response"] == ["ab"]
    with pytest.raises(ValueError, match="3 tokens but 2 logprobs"):
        generations_to_batch(prompts, [Generation(0, ids(tok, "ab."), [-1.0, -1.0], "stop")],
                             tok.pad_token_id, 0, tok)


def test_rollout_logprobs_match_a_training_style_forward_over_the_batch(tmp_path):
    """What the trainer relies on: a right-padded forward over `tokens` reproduces rollout_logprobs."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.hf import HFRolloutEngine

    path = str(build_tiny_model(tmp_path / "model", seed=2))
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFRolloutEngine(path, seed=0)
    prompts = [{"prompt": p, "prompt_ids": ids(tok, p), "answer": ""} for p in ("ab>", "hello>")]
    gens = engine.generate([p["prompt_ids"] for p in prompts], SamplingParams(max_new_tokens=6, n=3))
    batch = generations_to_batch(prompts, gens, tok.pad_token_id, 0, tok)
    with torch.no_grad():
        logits = engine.model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"]).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["tokens"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].bool()
    assert mask.sum() == sum(len(g.token_ids) for g in gens)
    torch.testing.assert_close(lp[mask], batch["rollout_logprobs"][:, 1:][mask], atol=1e-5, rtol=0)


def test_policy_version_is_the_oldest_tokens_where_the_engine_reports_versions(tok):
    prompts = [{"prompt": "a>", "prompt_ids": ids(tok, "a>"), "answer": ""}]
    gens = [Generation(0, ids(tok, "bcd"), [-1.0] * 3, "length", versions=[4, 5, 5]),  # a partial rollout
            Generation(0, ids(tok, "bc"), [-1.0] * 2, "length", versions=[5, 5]),
            Generation(0, ids(tok, "b"), [-1.0], "length")]  # no versions reported: the caller's
    batch = generations_to_batch(prompts, gens, tok.pad_token_id, policy_version=5, tokenizer=tok)
    assert batch["policy_version"].tolist() == [4, 5, 5]
