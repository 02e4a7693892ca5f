"""The planner: published parameter totals, hand-computed traffic and memory, the CLI and its errors."""

import pytest

from megarl.reshard.inventory import hf_inventory
from megarl.reshard.layout import TrainLayout
from megarl.reshard.plan import kv_bytes_per_token, load_model_config, main, parse_layout, plan


@pytest.mark.parametrize("name,billions", [("qwen2.5-0.5b", 0.494), ("qwen2.5-1.5b", 1.544), ("qwen2.5-7b", 7.616),
                                           ("qwen3-235b-a22b", 235.09), ("deepseek-v3", 671.03)])
def test_parameter_totals_match_the_published_sizes(name, billions):
    total = sum(s.numel for s in hf_inventory(load_model_config(name)))
    assert total / 1e9 == pytest.approx(billions, rel=2e-3)


# 2 layers, hidden 4, 4 heads (head_dim 1), 2 KV heads, FFN 8, vocab 6, untied, llama (no biases).
# Per layer: q 16 + k 8 + v 8 + o 16 + gate, up, down 3 * 32 split elements, two norms of 4;
# embedding and head 24 each, final norm 4.
TINY = dict(model_type="llama", vocab_size=6, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
SPLIT_PER_LAYER, NORMS_PER_LAYER = 16 + 8 + 8 + 16 + 32 * 3, 8


def test_traffic_by_hand():
    # TP 2 -> 1: each rank lacks the other half of every split tensor (bf16: 2 bytes), norms it has.
    r = plan(TINY, TrainLayout(2, 1, 1, 2), gen_tp=1)["ranks"]
    split = 24 + 24 + 2 * SPLIT_PER_LAYER
    assert [x["sharded_recv"] for x in r] == [split // 2 * 2] * 2 == [x["sharded_send"] for x in r]
    # TP 2 -> 2: the generation shard is the training shard; full delivery still needs the other half.
    r = plan(TINY, TrainLayout(2, 1, 1, 2), gen_tp=2)["ranks"]
    assert [x["sharded_recv"] for x in r] == [0, 0] and [x["full_recv"] for x in r] == [split, split]
    # PP 2 -> TP 1: stage 0 (embedding + layer 0) lacks layer 1 + norm + head, stage 1 the rest.
    r = plan(TINY, TrainLayout(1, 2, 1, 2), gen_tp=1)["ranks"]
    stage0 = 24 + SPLIT_PER_LAYER + NORMS_PER_LAYER
    stage1 = SPLIT_PER_LAYER + NORMS_PER_LAYER + 4 + 24
    assert [x["full_recv"] for x in r] == [2 * stage1, 2 * stage0] == [x["full_send"] for x in r][::-1]
    # TP 1, DP 2 -> TP 2 sharded: every rank already holds everything.
    r = plan(TINY, TrainLayout(1, 1, 2, 2), gen_tp=2)["ranks"]
    assert [x["sharded_recv"] for x in r] == [0, 0] and [x["full_recv"] for x in r] == [0, 0]


def test_memory_by_hand():
    r = plan(TINY, TrainLayout(2, 1, 2, 2), gen_tp=4, seq_len=8, micro_batch=1, kv_tokens=10,
             distributed_optimizer=True)["ranks"]
    params = (24 + 24 + 2 * SPLIT_PER_LAYER) // 2 + 2 * NORMS_PER_LAYER + 4
    assert r[0]["params"] == params and r[0]["weights"] == 2 * params and r[0]["grads"] == 4 * params
    assert r[0]["optimizer"] == 12 * params / 2
    assert r[0]["activations"] == 8 * 4 * (10 + 24 / 2) * 2  # s*b*h*(10+24/TP) * layers
    # CP 2 (of the 2 replicas): half of each sequence's activations per rank, the same weights and optimizer
    cp = plan(TINY, TrainLayout(2, 1, 2, 2), gen_tp=4, seq_len=8, distributed_optimizer=True, cp=2)["ranks"]
    assert cp[0]["activations"] == r[0]["activations"] / 2 and cp[0]["optimizer"] == r[0]["optimizer"]
    # K/V at generation TP 4 with 2 KV heads: each rank keeps one head (2 layers * K,V * head_dim 1 * bf16)
    assert r[0]["kv_cache"] == 10 * 2 * 2 * 1 * 1 * 2


def test_kv_cache_per_token():
    assert kv_bytes_per_token(load_model_config("qwen2.5-7b"), 2) == 28 * 2 * 2 * 128 * 2
    assert kv_bytes_per_token(load_model_config("deepseek-v3"), 8) == 61 * (512 + 64) * 2


def test_cli_prints_every_rank(capsys):
    main(["--model", "qwen2.5-7b", "--train", "tp=2,pp=2,dp=1", "--gen", "tp=4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("qwen2.5-7b: 7.62B parameters")
    assert [line.split()[0] for line in lines[3:]] == ["0", "1", "2", "3"]
    main(["--model", "qwen2.5-7b", "--train", "tp=2,cp=2,dp=2", "--gen", "tp=4"])
    lines = capsys.readouterr().out.splitlines()
    assert "train TP=2 PP=1 CP=2 DP=2 (8 GPUs)" in lines[0] and len(lines) == 3 + 8


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="bad layout entry 'tq=2'"):
        parse_layout("tq=2", ("tp", "pp", "dp"))
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model_config("no-such-model")
    with pytest.raises(ValueError, match="generation TP=3"):
        plan(TINY, TrainLayout(2, 1, 2, 2), gen_tp=3)
    with pytest.raises(ValueError, match="does not divide its 3 heads"):
        plan(dict(TINY, num_key_value_heads=3, num_attention_heads=3, hidden_size=6), TrainLayout(2, 1, 1, 2), 2)
