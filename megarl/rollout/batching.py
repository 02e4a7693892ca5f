"""Turning a rollout's generations into a Batch in the token layout of megarl.protocol."""

from __future__ import annotations

import torch

from megarl.protocol import IMAGE_INPUTS, REWARD_FIELDS, Batch
from megarl.rollout.base import Generation, ImageInputs


def prompt_images(prompts: list[dict]) -> list[ImageInputs | None] | None:
    """Each prompt's images for RolloutEngine.generate (None for a text-only prompt; megarl.data.images gives a
    prompt with images `pixel_values` and `image_grid_thw`), or None where no prompt has any."""
    images = [ImageInputs(*(p[k] for k in IMAGE_INPUTS)) if p.get(IMAGE_INPUTS[0]) is not None else None
              for p in prompts]
    return images if any(i is not None for i in images) else None


def generations_to_batch(prompts: list[dict], generations: list[Generation], pad_id: int, policy_version: int,
                         tokenizer) -> Batch:
    """One row per generation: tokens = prompt_ids + response ids, right-padded with `pad_id`.

    `prompts[i]` has `prompt_ids`, `prompt` and `answer` (and may have REWARD_FIELDS); `generations[j].prompt_index`
    points into it.
    loss_mask and rollout_logprobs are set at exactly the response positions (rollout_logprobs[t] is
    the engine's log p(tokens[t] | tokens[<t])). `response` is the decoded text without the stop token.
    policy_version per row: its oldest token's version where the generation has versions, else `policy_version`.
    Prompts with images give every row of theirs the same `pixel_values` and `image_grid_thw` (per-row fields that
    MegatronEngine reads; None for a text-only row).
    """
    responses = []
    for i, g in enumerate(generations):
        if len(g.logprobs) != len(g.token_ids):
            raise ValueError(f"generation {i} has {len(g.token_ids)} tokens but {len(g.logprobs)} logprobs")
        text_ids = g.token_ids[:-1] if g.finish_reason == "stop" else g.token_ids
        responses.append(tokenizer.decode(text_ids, skip_special_tokens=True))
    tensors = rows_to_tensors([prompts[g.prompt_index]["prompt_ids"] for g in generations],
                              [g.token_ids for g in generations], [[1.0] * len(g.token_ids) for g in generations],
                              [g.logprobs for g in generations], pad_id)
    # the oldest policy that wrote a row's tokens, where the engine reports versions (partial rollouts span several)
    versions = [min(g.versions) if g.versions else policy_version for g in generations]
    images = {k: [prompts[g.prompt_index][k] for g in generations] for k in IMAGE_INPUTS} \
        if prompt_images(prompts) is not None else {}
    if any(g.routed_experts is not None for g in generations):
        tensors["routed_experts"] = routed_experts_tensor([g.routed_experts for g in generations],
                                                          tensors["tokens"].shape[1])
    return Batch(
        tensors | {"policy_version": torch.tensor(versions, dtype=torch.long)},
        {"group": [g.prompt_index for g in generations],
         "prompt": [prompts[g.prompt_index]["prompt"] for g in generations],
         "response": responses,
         "answer": [prompts[g.prompt_index]["answer"] for g in generations]}
        | {k: [prompts[g.prompt_index].get(k) for g in generations] for k in REWARD_FIELDS} | images)


def rows_to_tensors(prompt_ids: list[list[int]], response_ids: list[list[int]], loss_masks: list[list[float]],
                    logprobs: list[list[float]], pad_id: int) -> dict[str, torch.Tensor]:
    """tokens = prompt + response per row, right-padded; loss_mask and rollout_logprobs over the response."""
    n, width = len(prompt_ids), max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    rollout_logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        end = len(p) + len(r)
        tokens[i, :end] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, :end] = 1
        loss_mask[i, len(p):end] = torch.tensor(loss_masks[i], dtype=torch.float32)
        rollout_logprobs[i, len(p):end] = torch.tensor(logprobs[i], dtype=torch.float32)
    return {"tokens": tokens, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "rollout_logprobs": rollout_logprobs}


def routed_experts_tensor(records: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """Per row [tokens, layers, topk] records (Generation.routed_experts) -> [B, width, layers, topk] int16 aligned
    to the batch's tokens, -1 past a row's record (its last token, padding)."""
    shape = next(r.shape[1:] for r in records if r is not None)
    out = torch.full((len(records), width, *shape), -1, dtype=torch.int16)
    for i, record in enumerate(records):
        if record is None:
            raise ValueError(f"row {i} of the rollout has no routed experts while others have: every row needs them "
                             "for actor.router_replay=rollout")
        if record.shape[1:] != shape:
            raise ValueError(f"row {i}'s routed experts are {tuple(record.shape)}, row 0's [tokens, {shape}]")
        n = min(record.shape[0], width)
        out[i, :n] = record[:n]
    return out
