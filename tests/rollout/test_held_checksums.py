"""SGLang's checksums of a verified sync taken bucket by bucket as the buckets load (held_checksums.py, run by
megarl's persistent loader cuda_ipc.load_flat_bucket), with the parameters each bucket completes named by the
sender's ExpectedChecksums: they must equal the checksums of everything held after the last load, on the DeepSeek
rank of fake_sglang_deepseek.py at TP=2 (fused a-projections, derived w_kc/w_vc, the fp32 routing bias)."""

import json
import os

import pytest
import torch

from megarl.reshard.inventory import hf_inventory
from megarl.rollout.transports.cuda_ipc import flat_layout, inspect_weights, load_flat_bucket, pack
from megarl.rollout.transports.held_checksums import held_checksums
from megarl.rollout.weight_layout import ExpectedChecksums, WeightLayout, keep_fused_pairs
from megarl.workers.weight_sync import WeightSyncError, verify_checksums
from tests.rollout.test_weight_layout_deepseek import V3, _buckets, _held, _server, _tensors

QWEN2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=8, num_attention_heads=2,
             num_key_value_heads=1, intermediate_size=16, num_hidden_layers=1, vocab_size=64,
             tie_word_embeddings=False)


def test_a_parameter_completes_with_the_last_tensor_that_writes_it():
    """q/k/v in three buckets: qkv_proj is whole after v's only; each parameter is named once per sync, every sync."""
    layout = WeightLayout(hf_inventory(QWEN2), "sglang", 2, hf=QWEN2)
    expected = ExpectedChecksums(layout, [0, 1])
    tensors = {s.name: torch.zeros(s.shape, dtype=torch.bfloat16) for s in hf_inventory(QWEN2)}
    attn = "model.layers.0.self_attn."
    for _ in range(2):
        expected.begin()
        named = []
        for name, t in tensors.items():
            expected.add(name, t)
            done = expected.completed()
            assert set(done) <= {0, 1} and done.get(0) == done.get(1)  # both ranks hold every parameter here
            named += [(name, param) for param in done.get(0, [])]
        whole = dict((param, name) for name, param in named)
        assert whole[attn + "qkv_proj.weight"] == attn + "v_proj.weight"
        assert whole["model.layers.0.mlp.gate_up_proj.weight"] == "model.layers.0.mlp.up_proj.weight"
        assert whole["lm_head.weight"] == "lm_head.weight"
        assert sorted(param for _, param in named) == sorted(layout.parameters(0))  # each once


def test_sums_taken_as_buckets_load_equal_the_checksums_of_everything_held(tmp_path):
    tp, ranks = 2, _server(V3, 2)
    expected = ExpectedChecksums(WeightLayout(hf_inventory(V3), "sglang", tp, hf=V3), list(range(tp)))
    for seed in (0, 1):  # a second sync reuses the table and rows and sums new values
        buckets = list(keep_fused_pairs(_buckets(_tensors(V3, seed), 5)))
        expected.begin()
        files = [str(tmp_path / f"sync{seed}_rank{rank}.json") for rank in range(tp)]
        for k, bucket in enumerate(buckets):
            for name, t in bucket:
                expected.add(name, t)
            complete = expected.completed()
            layout, size = flat_layout(bucket)
            flat = pack(bucket, torch.empty(size, dtype=torch.uint8))
            for rank, model in enumerate(ranks):
                header = {"slot": k % 2, "layout": layout, "sync": expected.sync_id, "complete": complete.get(rank, [])}
                if k == len(buckets) - 1:
                    header["checksums"] = True  # the last bucket: the rest queued, not waited for
                load_flat_bucket(model, [(json.dumps(header), flat)])
                if k == 0:  # summed at the first bucket's load: what it completed, nothing more
                    assert set(held_checksums(model).summed) == set(complete.get(rank, [])) != set()
        flipped = "model.layers.0.self_attn.kv_a_layernorm.weight"
        for rank, model in enumerate(ranks):
            assert held_checksums(model).pending is not None and not os.path.exists(files[rank])  # not waited for
            if seed == 1 and rank == 0:  # a bit flipped after the load: the sums queued before it are dropped
                inspect_weights(model, {"flip_bit": flipped})
            inspect_weights(model, {"checksums": files[rank]})  # the later request collects them
        got = {0: {rank: json.loads(open(path).read()) for rank, path in enumerate(files)}}
        assert got == _held(ranks, tmp_path)  # inspect_weights now: everything held, after the last load
        if seed == 0:
            verify_checksums(expected.result(), got)
        else:
            with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank 0: {flipped}'\]"):
                verify_checksums(expected.result(), got)
