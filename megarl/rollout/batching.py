"""Turning a rollout's generations into a Batch in the token layout of megarl.protocol."""

from __future__ import annotations

import torch

from megarl.protocol import Batch
from megarl.rollout.base import Generation


def generations_to_batch(prompts: list[dict], generations: list[Generation], pad_id: int, policy_version: int,
                         tokenizer) -> Batch:
    """One row per generation: tokens = prompt_ids + response ids, right-padded with `pad_id`.

    `prompts[i]` has `prompt_ids`, `prompt` and `answer`; `generations[j].prompt_index` points into it.
    loss_mask and rollout_logprobs are set at exactly the response positions (rollout_logprobs[t] is
    the engine's log p(tokens[t] | tokens[<t])). `response` is the decoded text without the stop token.
    """
    rows = [prompts[g.prompt_index]["prompt_ids"] + g.token_ids for g in generations]
    width = max(len(r) for r in rows)
    n = len(generations)
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    rollout_logprobs = torch.zeros((n, width), dtype=torch.float32)
    responses = []
    for i, (row, g) in enumerate(zip(rows, generations)):
        if len(g.logprobs) != len(g.token_ids):
            raise ValueError(f"generation {i} has {len(g.token_ids)} tokens but {len(g.logprobs)} logprobs")
        start = len(row) - len(g.token_ids)
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, :len(row)] = 1
        loss_mask[i, start:len(row)] = 1.0
        rollout_logprobs[i, start:len(row)] = torch.tensor(g.logprobs, dtype=torch.float32)
        text_ids = g.token_ids[:-1] if g.finish_reason == "stop" else g.token_ids
        responses.append(tokenizer.decode(text_ids, skip_special_tokens=True))
    return Batch(
        {"tokens": tokens, "attention_mask": attention_mask, "loss_mask": loss_mask,
         "rollout_logprobs": rollout_logprobs,
         "policy_version": torch.full((n,), policy_version, dtype=torch.long)},
        {"group": [g.prompt_index for g in generations],
         "prompt": [prompts[g.prompt_index]["prompt"] for g in generations],
         "response": responses,
         "answer": [prompts[g.prompt_index]["answer"] for g in generations]})
