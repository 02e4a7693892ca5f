import pytest
import torch
from transformers import AutoTokenizer

from megarl.models.tiny import build_tiny_model
from megarl.rollout.base import SamplingParams
from megarl.rollout.hf import HFRolloutEngine

PROMPTS = ["abcd>", "x>", "hello world>", "12+345="]  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1))


@pytest.fixture(scope="module")
def prompts(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


@pytest.fixture
def engine(model_dir):
    return HFRolloutEngine(model_dir, seed=0)


def full_sequence_logprobs(model, prompt, response):
    """log_softmax of one unpadded forward pass over prompt + response, at the response tokens."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_greedy_equals_a_manual_argmax_loop(engine, prompts):
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    for g, prompt in zip(gens, prompts):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(engine.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax().item())
        assert g.token_ids == seq[len(prompt):] and g.finish_reason == "length"


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)])
def test_logprobs_are_raw_policy_logprobs(engine, prompts, temperature, top_p):
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, n=3))
    for g in gens:
        ref = full_sequence_logprobs(engine.model, prompts[g.prompt_index], g.token_ids)
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-5, rtol=0)


def test_n_samples_grouped_by_prompt_and_seeded(model_dir, prompts):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4)
    gens = HFRolloutEngine(model_dir, seed=5).generate(prompts, params)
    assert [g.prompt_index for g in gens] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert len({tuple(g.token_ids) for g in gens[:4]}) > 1  # samples of one prompt differ
    again = HFRolloutEngine(model_dir, seed=5).generate(prompts, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]
    other = HFRolloutEngine(model_dir, seed=6).generate(prompts, params)
    assert [g.token_ids for g in other] != [g.token_ids for g in gens]


def test_top_p_keeps_only_the_nucleus(engine, prompts):
    # with a tiny nucleus only the most likely token survives: sampling becomes greedy
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    nucleus = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-6))
    assert [g.token_ids for g in nucleus] == [g.token_ids for g in greedy]


def test_top_k_reaches_the_sampler(engine, prompts):
    # top_k=1 keeps only the most likely token: sampling at any temperature becomes greedy
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    top_1 = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.5, top_k=1, n=2, seed=3))
    assert [g.token_ids for g in top_1] == [g.token_ids for g in greedy for _ in range(2)]
    # and the log-probs stay the raw policy's, not the top-k distribution's (which gives the kept token 1)
    assert all(lp < 0 for g in top_1 for lp in g.logprobs)


def test_stops_at_eos(engine, prompts):
    eos = engine.eos_ids[0]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=32, temperature=1.0, n=8, seed=0))
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert 0 < len(stopped) < len(gens)  # some rows stop early while the batch runs on
    for g in gens:
        assert len(g.logprobs) == len(g.token_ids)
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == eos and eos not in g.token_ids[:-1]
        else:
            assert len(g.token_ids) == 32 and eos not in g.token_ids


def test_ignore_eos_runs_every_row_to_max_new_tokens(engine, prompts):
    eos = engine.eos_ids[0]
    params = SamplingParams(max_new_tokens=32, temperature=1.0, n=8, seed=0)
    stopping = engine.generate(prompts, params)
    fixed = engine.generate(prompts, SamplingParams(**vars(params) | {"ignore_eos": True}))
    assert any(g.finish_reason == "stop" for g in stopping)  # the same draws stop early without ignore_eos
    assert all(len(g.token_ids) == 32 and g.finish_reason == "length" for g in fixed)
    assert any(eos in g.token_ids for g in fixed)  # EOS was sampled and generation went on past it


def test_custom_stop_token_ends_generation(model_dir, prompts):
    engine = HFRolloutEngine(model_dir, seed=0)
    free = engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    stop = free.token_ids[2]
    cut = engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop]))[0]
    first = free.token_ids.index(stop)
    assert cut.token_ids == free.token_ids[:first + 1] and cut.finish_reason == "stop"
    assert cut.logprobs == pytest.approx(free.logprobs[:first + 1], abs=1e-6)


def test_update_weights_changes_outputs_and_named_weights_round_trip(engine, prompts):
    before = engine.named_weights()
    assert "lm_head.weight" not in before  # tied to the embedding
    assert "model.layers.0.self_attn.q_proj.bias" in before
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    greedy_before = [g.token_ids for g in engine.generate(prompts, params)]

    gen = torch.Generator().manual_seed(0)
    new = {name: t + 0.5 * torch.randn(t.shape, generator=gen) for name, t in before.items()}
    engine.update_weights(list(new.items())[:3])  # one bucket ...
    engine.update_weights(list(new.items())[3:])  # ... then the rest
    after = engine.named_weights()
    assert after.keys() == new.keys() and all(torch.equal(after[k], new[k]) for k in new)
    assert torch.equal(engine.model.lm_head.weight, new["model.embed_tokens.weight"])  # tie followed
    assert [g.token_ids for g in engine.generate(prompts, params)] != greedy_before

    with pytest.raises(KeyError, match="no weight named 'model.nope'"):
        engine.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_mixtral_weights_go_by_their_checkpoint_names(tmp_path):
    """transformers 5 holds Mixtral's experts fused under mlp.experts; the engine takes and reports them by the
    checkpoint's (and the trainer's) names, block_sparse_moe.experts.{e}.w1/w3/w2, each a view of its slice."""
    from safetensors.torch import load_file

    from tests.models.hf_families import mixtral_config, save_random

    model_dir = save_random(mixtral_config(), tmp_path / "mixtral", seed=5)
    engine = HFRolloutEngine(model_dir, seed=0)
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    held = engine.named_weights()
    assert held.keys() == checkpoint.keys() and all(torch.equal(held[k], checkpoint[k]) for k in checkpoint)

    expert = "model.layers.1.block_sparse_moe.experts.2."
    up = torch.full_like(checkpoint[expert + "w3.weight"], 0.25)
    engine.update_weights([(expert + "w3.weight", up)])
    fused = engine.model.model.layers[1].mlp.experts.gate_up_proj[2]  # [gate rows; up rows]
    assert torch.equal(fused[up.shape[0]:], up) and torch.equal(fused[:up.shape[0]], checkpoint[expert + "w1.weight"])
