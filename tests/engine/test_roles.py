"""The critic, the reward model and the frozen reference on the same engine, at TP=2 (2 gloo ranks, one
launch): value heads against transformers' Qwen2ForTokenClassification, a critic that learns values
(explained variance on held-out returns), a reward model trained on preference pairs (Bradley-Terry)
under sequence parallelism, and offloading weights, grads and optimizer state."""

import torch
from transformers import Qwen2Config, Qwen2ForTokenClassification

from megarl.config import ActorConfig, AlgorithmConfig, CriticConfig, OptimConfig, ParallelConfig, RewardModelConfig
from megarl.engine import offload
from megarl.protocol import Batch
from tests.dist_utils import run_distributed
from tests.engine.hf_models import VOCAB, hf_logprobs_entropy, make_qwen2_dir, padded_batch

SIGNAL = {5: 1.0, 6: -1.0}  # the first token decides the return of every response token
PROMPT, LENGTH = 3, 10


def value_task(n: int, seed: int) -> Batch:
    """Sequences whose response tokens all have return +1 or -1, given by the first token (learnable only by
    attending back to it); lengths vary so that packing has something to do."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, VOCAB, (n, LENGTH), generator=g)
    first = torch.tensor(list(SIGNAL))[torch.randint(0, 2, (n,), generator=g)]
    tokens[:, 0] = first
    lengths = torch.randint(PROMPT + 2, LENGTH + 1, (n,), generator=g)
    attention_mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    loss_mask = attention_mask.float()
    loss_mask[:, :PROMPT] = 0
    returns = torch.tensor([SIGNAL[int(t)] for t in first])[:, None] * loss_mask
    return Batch({"tokens": tokens * attention_mask, "attention_mask": attention_mask, "loss_mask": loss_mask,
                  "returns": returns})


def preference_pairs(n_pairs: int, seed: int) -> Batch:
    """Rows 2k (chosen) and 2k+1 (rejected): the same random prefix, then token 5 (chosen) or 6 (rejected)."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for _ in range(n_pairs):
        n = int(torch.randint(3, LENGTH, (1,), generator=g))
        prefix = torch.randint(10, VOCAB, (n,), generator=g)
        for last in (5, 6):
            row = torch.zeros(LENGTH, dtype=torch.long)
            row[:n], row[n] = prefix, last
            rows.append(row)
            masks.append((torch.arange(LENGTH) <= n).long())
    attention_mask = torch.stack(masks)
    return Batch({"tokens": torch.stack(rows), "attention_mask": attention_mask,
                  "loss_mask": attention_mask.float()})


def explained_variance(values, returns, mask) -> float:
    real = mask > 0
    return 1.0 - ((returns - values)[real].var() / returns[real].var()).item()


def _state(engine) -> list[torch.Tensor]:
    """What an onload restores bit for bit (not the gradient buffers: every update zeroes them first)."""
    return [t.detach().clone() for t in engine._offload_plan()[0]]


def _roles_rank(rank, policy_dir):
    from megarl.engine import MegatronEngine

    tp2 = ParallelConfig(world_size=2, tp=2)
    out = {}

    # --- the critic: from the policy checkpoint, a zero value head; learns the task's values -------------
    critic_cfg = CriticConfig(parallel=tp2, micro_batch_size=8, max_tokens_per_micro_batch=40, value_clip=0.5,
                              optim=OptimConfig(lr=3e-3))
    critic = MegatronEngine(policy_dir, critic_cfg, AlgorithmConfig(), "cpu", 1, 100, head="value")
    held_out = value_task(64, seed=99)
    out["initial_values"] = critic.compute_values(held_out)["values"]
    metrics = []
    for step in range(25):
        batch = value_task(32, seed=step)
        batch.update(critic.compute_values(batch))
        metrics.append(critic.train(batch, loss="value"))
    out["critic_metrics"] = metrics
    out["held_out"] = held_out
    out["held_out_values"] = critic.compute_values(held_out)["values"]
    out["critic_weights"] = {n: t for bucket in critic.export_hf_weights(1 << 30) for n, t in bucket}

    # --- offload / onload: storages freed, weights and optimizer state back bit for bit ---------------------
    before, resident = _state(critic), critic.resident_bytes()
    moved = critic.offload()
    out["offload"] = (resident, moved, critic.resident_bytes())
    critic.onload()
    out["onload_equal"] = all(torch.equal(a, b) for a, b in zip(before, _state(critic)))
    out["grad_bytes"] = sum(t.numel() * t.element_size() for m in critic.models for t in offload.ddp_grad_buffers(m))
    out["values_after_onload"] = critic.compute_values(held_out)["values"]

    # --- a reward model trained on preference pairs through the same engine -------------------------------
    # under sequence parallelism: the value head gathers the TP group's tokens first; one row per micro-batch
    # (pairs in the same row, rows cut to their used length)
    rm_cfg = RewardModelConfig(parallel=ParallelConfig(world_size=2, tp=2, sequence_parallel=True),
                               micro_batch_size=4, max_tokens_per_micro_batch=20, packing="one_row",
                               optim=OptimConfig(lr=3e-3))
    rm = MegatronEngine(policy_dir, rm_cfg, AlgorithmConfig(), "cpu", 1, 100, head="value")
    assert rm.gpt.config.sequence_parallel
    out["bt_metrics"] = [rm.train(preference_pairs(16, seed=step), loss="bradley_terry") for step in range(15)]
    pairs = preference_pairs(32, seed=99)
    out["pairs"] = pairs
    out["pair_rewards"] = rm.compute_rewards(pairs)["rewards"]
    out["rm_weights"] = {n: t for bucket in rm.export_hf_weights(1 << 30) for n, t in bucket}
    try:  # the critic's loss reads keys a reward model's section does not have
        rm.train(value_task(4, seed=0), loss="value")
        out["rm_value_error"] = None
    except ValueError as e:
        out["rm_value_error"] = str(e)

    # --- the frozen reference: no optimizer, offloadable -------------------------------------------------
    ref = MegatronEngine(policy_dir, ActorConfig(parallel=tp2, micro_batch_size=4), AlgorithmConfig(), "cpu", 1, 10,
                         trainable=False)
    out["ref_logprobs"] = ref.compute_logprobs(padded_batch())["logprobs"]
    try:
        ref.train(padded_batch(), loss="sft")
        out["frozen_train_error"] = None
    except RuntimeError as e:
        out["frozen_train_error"] = str(e)
    out["ref_offload"] = (ref.optimizer, ref.offload(), ref.resident_bytes())
    ref.onload()
    out["ref_logprobs_after_onload"] = ref.compute_logprobs(padded_batch())["logprobs"]
    return out


def _hf_values(policy_dir, weights: dict, batch: Batch) -> torch.Tensor:
    """transformers' token-classification head (num_labels=1) on the exported weights: [B, T] per position.
    Its head has a bias, megarl's (like Qwen2ForSequenceClassification's) none: it is set to 0."""
    config = Qwen2Config.from_pretrained(policy_dir, num_labels=1)
    model = Qwen2ForTokenClassification(config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert missing == ["score.bias"] and not unexpected, (missing, unexpected)
    torch.nn.init.zeros_(model.score.bias)
    with torch.no_grad():
        return model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"]).logits[..., 0]


def test_critic_reward_model_reference_and_offload(tmp_path):
    policy_dir = make_qwen2_dir(tmp_path / "policy", tied=True)
    out = run_distributed(_roles_rank, 2, policy_dir, tp=2)

    # The critic starts from the policy with a zero head, and learns: held-out explained variance > 0.5.
    held_out, values = out["held_out"], out["held_out_values"]
    assert out["initial_values"].abs().max() == 0
    mask = held_out["loss_mask"]
    ev = explained_variance(values, held_out["returns"], mask)
    assert ev > 0.5, ev
    losses = [m["vf_loss"] for m in out["critic_metrics"]]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(m["vf_clipfrac"] >= 0 for m in out["critic_metrics"])
    # Values are V(tokens[<t]): transformers' head at position t-1, on the exported weights (score.weight).
    hf = _hf_values(policy_dir, out["critic_weights"], held_out)
    real = held_out["attention_mask"][:, 1:] > 0
    torch.testing.assert_close(values[:, 1:][real], hf[:, :-1][real], rtol=0, atol=1e-4)
    assert (values[:, 0] == 0).all() and (values[:, 1:][~real] == 0).all()

    # Offload frees every storage and onload restores every value.
    resident, moved, after = out["offload"]
    assert resident > 0 and after == 0  # fp32: everything but the grads is copied
    assert moved == {"copied": resident - out["grad_bytes"], "freed": resident} and out["grad_bytes"] > 0
    assert out["onload_equal"] and torch.equal(out["values_after_onload"], values)

    # The reward model learns the preference, and reads the value head at each sequence's last token.
    bt = out["bt_metrics"]
    assert bt[-1]["loss"] < 0.5 * bt[0]["loss"], [m["loss"] for m in bt]
    rewards, pairs = out["pair_rewards"], out["pairs"]
    assert (rewards[0::2] > rewards[1::2]).float().mean() >= 0.9
    hf = _hf_values(policy_dir, out["rm_weights"], pairs)
    last = pairs["attention_mask"].sum(1) - 1
    torch.testing.assert_close(rewards, hf[torch.arange(len(pairs)), last], rtol=0, atol=1e-4)
    assert out["rm_value_error"] == ("loss='value' reads ppo_epochs, value_clip, which this engine's section "
                                     "(RewardModelConfig) does not have")

    # The frozen reference: the policy's log-probs, no optimizer, no training, offloadable.
    ref_logprobs, _ = hf_logprobs_entropy(policy_dir, padded_batch())
    torch.testing.assert_close(out["ref_logprobs"], ref_logprobs, rtol=0, atol=1e-5)
    assert "trainable=False" in out["frozen_train_error"]
    optimizer, moved, after = out["ref_offload"]
    assert optimizer is None and moved["copied"] == moved["freed"] > 0 and after == 0
    assert torch.equal(out["ref_logprobs_after_onload"], out["ref_logprobs"])
