"""Micro-batches without padding: whole sequences packed into rows by a token budget.

A micro-batch is `tokens` [rows, L], L = the longest sequence of this rank's batch. Each row holds one or
more whole sequences back to back; position ids restart at 0 for every sequence and the attention
mask is block-diagonal causal, so a packed sequence sees exactly what it would see alone. With
`max_tokens` > 0 sequences are packed first-fit-decreasing into micro-batches of max_tokens // L rows;
with max_tokens = 0 each row holds one sequence, `micro_batch_size` rows per micro-batch, in batch order.
All micro-batches have the same shape: pipeline stages exchange fixed-shape activations. With sequence
parallelism L is rounded up to a multiple of the TP size (`width_multiple`), which splits rows by token.

layout='one_row' (actor.packing=one_row): a micro-batch is ONE row [1, W], W = max_tokens rounded up to
`width_multiple`, holding any number of whole sequences first-fit-decreasing (groups kept together), so rows
are no longer as wide as the longest sequence. `trim_multiple` > 0 cuts each row to its used length rounded
up to that multiple (shapes then differ between micro-batches: only where nothing needs fixed shapes, i.e.
no pipeline stages and no expert exchange across DP ranks; see MegatronEngine._micro_batches). A sequence
longer than W is an error naming actor.max_tokens_per_micro_batch. With max_tokens = 0 (the default) W is automatic:
micro_batch_size x L, L the rows layout's width (the longest sequence of the batch, or `longest`, rounded up to
`width_multiple`), i.e. as many token slots as the rows layout's micro-batch. Every sequence fits, and a micro-batch
holds no more tokens than the rows layout's (with trim, fewer), so activations linear in tokens (varlen attention,
the MLP, the LM head) peak no higher; attention by a dense mask ([W, W]: local, sdpa, context parallelism) would grow
with W^2, micro_batch_size times the rows layout's [L, L] masks (the engine keeps padded rows there).
First-fit-decreasing then needs at most as many micro-batches as rows (a micro-batch with fewer than micro_batch_size
sequences has room for any sequence, so a new one opens only when every earlier one holds micro_batch_size or more).

Everything per sequence (loss_mask, advantages, old log-probs ...) stays in the ordinary [S, T] layout
of the Batch; `packed_index` [S, T] points each (sequence, position) at its packed position, and
`unpack` moves a per-position model output ([rows, L, ...]) into that layout, so losses never see
packing. `seq_index` [S] gives the rows of the original batch the micro-batch's sequences come from.

A vision-language batch (megarl/models/qwen2_vl.py) carries `mrope_position_ids` [S, 3, T] (M-RoPE: position_ids
become [3, rows, L], each sequence's own) and per sequence its images (`pixel_values` [patches, D] and
`image_grid_thw` [images, 3], or None): a micro-batch holds its sequences' images concatenated in the order their
sequences are laid out (row by row), which is the order of the image placeholder tokens in its rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.config.validation import PACKING_LAYOUTS
from megarl.protocol import Batch

IMAGE_INPUTS = ("pixel_values", "image_grid_thw")  # per-sequence non-tensor fields of a vision-language batch


def sequence_lengths(attention_mask: Tensor) -> list[int]:
    """Tokens up to and including the last real one, per row (at least 1, so empty rows still map)."""
    positions = torch.arange(1, attention_mask.shape[1] + 1)
    return [max(int(n), 1) for n in (positions * (attention_mask.cpu() > 0)).max(1).values]


def balanced_partition(lengths: list[int], parts: int, group_size: int = 1) -> list[list[int]]:
    """Split row indices into `parts` lists of equal size with near-equal total length (longest groups
    first, each to the part with the fewest tokens that has room). Groups of `group_size` consecutive
    rows (e.g. preference pairs) stay together. Each list is in ascending row order."""
    if len(lengths) % (parts * group_size):
        raise ValueError(f"a batch of {len(lengths)} rows does not split into {parts} equal parts of whole "
                         f"groups of {group_size}")
    groups = [list(range(i, i + group_size)) for i in range(0, len(lengths), group_size)]
    groups.sort(key=lambda g: -sum(lengths[i] for i in g))
    capacity = len(groups) // parts
    tokens, members = [0] * parts, [[] for _ in range(parts)]
    for group in groups:
        part = min((p for p in range(parts) if len(members[p]) < capacity), key=lambda p: tokens[p])
        members[part].append(group)
        tokens[part] += sum(lengths[i] for i in group)
    return [sorted(i for g in m for i in g) for m in members]


def _first_fit(lengths: list[int], width: int, rows_per_mb: int, group_size: int) -> list[list[list[int]]]:
    """Micro-batches of rows of sequence indices: groups longest first, each into the first micro-batch
    whose rows can take all of its sequences (first-fit per sequence)."""
    groups = [list(range(i, min(i + group_size, len(lengths)))) for i in range(0, len(lengths), group_size)]
    groups.sort(key=lambda g: -sum(lengths[i] for i in g))
    mbs: list[list[list[int]]] = []  # micro-batch -> row -> sequence indices
    free: list[list[int]] = []       # micro-batch -> row -> free columns

    def place(mb: int, group: list[int]) -> bool:
        room = list(free[mb])
        slots = []
        for i in group:
            row = next((r for r, f in enumerate(room) if f >= lengths[i]), None)
            if row is None:
                return False
            room[row] -= lengths[i]
            slots.append(row)
        for i, row in zip(group, slots):
            mbs[mb][row].append(i)
        free[mb] = room
        return True

    for group in groups:
        if not any(place(mb, group) for mb in range(len(mbs))):
            mbs.append([[] for _ in range(rows_per_mb)])
            free.append([width] * rows_per_mb)
            if not place(len(mbs) - 1, group):
                raise ValueError(f"sequences {group} (lengths {[lengths[i] for i in group]}) do not fit one "
                                 f"micro-batch of {rows_per_mb} rows x {width} tokens")
    return mbs


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_micro_batches(batch: Batch, keys: list[str], device, micro_batch_size: int, max_tokens: int = 0,
                       group_size: int = 1, width_multiple: int = 1, longest: int = 0, layout: str = "rows",
                       trim_multiple: int = 0) -> list[dict]:
    """Micro-batches for megatron's schedule (see the module docstring for the layouts). `longest`: lay the rows
    out for sequences up to that length at least (ranks that must agree on the shape pass the same value).

    Each dict holds 'tokens', 'position_ids', 'doc_ids' [rows, L] (doc_ids: 1.. per sequence of a row,
    0 on padding), 'cu_seqlens' (segment_bounds of doc_ids), 'packed' (whether some row holds several
    sequences), 'seq_index' [S], 'packed_index' [S, T'], and 'attention_mask' plus every name in `keys` in
    the per-sequence layout [S, T'] (T' = L in the rows layout, the longest sequence in one_row)."""
    if layout not in PACKING_LAYOUTS:
        raise ValueError(f"packing layout {layout!r}: expected one of {', '.join(PACKING_LAYOUTS)}")
    lengths = sequence_lengths(batch["attention_mask"])
    width = _round_up(max(max(lengths), longest), width_multiple)
    if max_tokens == 0 and micro_batch_size % group_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be a multiple of the group size {group_size}")
    if layout == "one_row":  # at max_tokens = 0 as many token slots as a micro-batch of micro_batch_size rows
        return _pack_one_row(batch, keys, device, lengths, max_tokens or micro_batch_size * width, group_size,
                             width_multiple, trim_multiple)
    if max_tokens > 0:
        rows_per_mb = max(1, max_tokens // width)
        layout = _first_fit(lengths, width, rows_per_mb, group_size)
    else:
        rows_per_mb = micro_batch_size
        layout = [[[i] for i in range(start, min(start + rows_per_mb, len(batch)))]
                  for start in range(0, len(batch), rows_per_mb)]
        layout[-1] += [[] for _ in range(rows_per_mb - len(layout[-1]))]
    return _fill(batch, keys, device, lengths, layout, [width] * len(layout), width)


def _pack_one_row(batch: Batch, keys: list[str], device, lengths: list[int], max_tokens: int, group_size: int,
                  width_multiple: int, trim_multiple: int) -> list[dict]:
    """layout='one_row': first-fit-decreasing into single rows of W = max_tokens (rounded to width_multiple)."""
    width = _round_up(max_tokens, width_multiple)
    too_long = [i for i, n in enumerate(lengths) if n > width]
    if too_long:
        raise ValueError(f"sequence {too_long[0]} has {lengths[too_long[0]]} tokens, more than one micro-batch row of "
                         f"{width} (actor.max_tokens_per_micro_batch={max_tokens}): raise "
                         "actor.max_tokens_per_micro_batch to at least the longest prompt + response")
    layout = _first_fit(lengths, width, 1, group_size)
    widths = [min(width, _round_up(sum(lengths[i] for i in rows[0]), trim_multiple)) if trim_multiple else width
              for rows in layout]
    return _fill(batch, keys, device, lengths, layout, widths, max(lengths))


def _fill(batch: Batch, keys: list[str], device, lengths: list[int], layout: list[list[list[int]]],
          widths: list[int], seq_width: int) -> list[dict]:
    """The micro-batch dicts of `layout` (micro-batch -> row -> sequence indices), micro-batch k's rows
    widths[k] wide; the per-sequence tensors seq_width wide."""
    tokens_all = batch["tokens"]
    # [S, seq_width]: cut to the longest sequence, or zero-padded up to the rounded width
    per_seq = {k: _fit_width(batch[k], seq_width) for k in ["attention_mask", *keys]}
    mrope = batch["mrope_position_ids"] if "mrope_position_ids" in batch else None
    out = []
    for rows, width in zip(layout, widths):
        rows_per_mb = len(rows)
        tokens = torch.zeros(rows_per_mb, width, dtype=tokens_all.dtype)
        positions = torch.zeros(*(() if mrope is None else (3,)), rows_per_mb, width, dtype=torch.long)
        doc_ids = torch.zeros(rows_per_mb, width, dtype=torch.long)
        seq_index, packed_index = [], []
        for r, seqs in enumerate(rows):
            offset = 0
            for doc, i in enumerate(seqs, start=1):
                n = lengths[i]
                tokens[r, offset:offset + n] = tokens_all[i, :n]
                positions[..., r, offset:offset + n] = torch.arange(n) if mrope is None else mrope[i, :, :n]
                doc_ids[r, offset:offset + n] = doc
                seq_index.append(i)
                # positions past the sequence's end point at its last token; `unpack` zeroes them
                packed_index.append(r * width + offset + torch.arange(seq_width).clamp(max=n - 1))
                offset += n
        index = torch.tensor(seq_index, dtype=torch.long)
        mb = _routed_experts(batch, layout_rows=rows, width=width, lengths=lengths)
        mb |= {"tokens": tokens, "position_ids": positions, "doc_ids": doc_ids, "cu_seqlens": segment_bounds(doc_ids),
              "seq_index": index, "packed_index": torch.stack(packed_index)}
        mb |= {k: v[index] for k, v in per_seq.items()}
        mb |= _images(batch, seq_index)
        mb = {k: v.to(device) for k, v in mb.items()}
        mb["packed"] = any(len(seqs) > 1 for seqs in rows)
        out.append(mb)
    return out


def _routed_experts(batch: Batch, layout_rows: list[list[int]], width: int, lengths: list[int]) -> dict:
    """The rollout's experts of the micro-batch's tokens (megarl/models/routing_replay.py), where the batch has them:
    'routed_experts' [rows, width, layers, topk] at the tokens' packed positions, -1 on padding."""
    if "routed_experts" not in batch:
        return {}
    routed = batch["routed_experts"]
    packed = torch.full((len(layout_rows), width, *routed.shape[2:]), -1, dtype=routed.dtype)
    for r, seqs in enumerate(layout_rows):
        offset = 0
        for i in seqs:
            n = min(lengths[i], routed.shape[1])
            packed[r, offset:offset + n] = routed[i, :n]
            offset += lengths[i]
    return {"routed_experts": packed}


def _images(batch: Batch, seq_index: list[int]) -> dict:
    """The images of these sequences, concatenated in their order; nothing when none has an image."""
    if IMAGE_INPUTS[0] not in batch:
        return {}
    found = [i for i in seq_index if batch[IMAGE_INPUTS[0]][i] is not None]
    return {k: torch.cat([batch[k][i] for i in found]) for k in IMAGE_INPUTS} if found else {}


def _fit_width(x: Tensor, width: int) -> Tensor:
    return x[:, :width] if x.shape[1] >= width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def segment_bounds(doc_ids: Tensor) -> Tensor:
    """cu_seqlens (int32) of the rows laid end to end: a segment is a run of one doc id within a row, so
    each sequence is one segment and a row's padding another. Causal attention within each segment is
    exactly block_causal_mask's attention."""
    flat = doc_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::doc_ids.shape[1]] = True
    bounds = torch.cat([starts.nonzero().squeeze(1), torch.tensor([flat.numel()], device=flat.device)])
    return bounds.to(torch.int32)


def block_causal_mask(doc_ids: Tensor) -> Tensor:
    """megatron's boolean mask [rows, 1, L, L], True where attention is NOT allowed: a query sees the
    earlier tokens of its own sequence only (padding, doc 0, sees padding, so no row is empty)."""
    L = doc_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_ids.device).triu(1)
    other_doc = doc_ids[:, :, None] != doc_ids[:, None, :]
    return (causal | other_doc).unsqueeze(1)


def unpack(packed: Tensor, mb: dict) -> Tensor:
    """[rows, L, ...] per packed position -> [S, L, ...] per sequence position, 0 past each sequence's end."""
    flat = packed.reshape(-1, *packed.shape[2:])
    out = flat[mb["packed_index"]]
    real = (mb["attention_mask"] > 0).reshape(*mb["attention_mask"].shape, *([1] * (packed.dim() - 2)))
    return torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device))


def next_tokens(tokens: Tensor) -> Tensor:
    """tokens[:, p + 1] for every packed position p (0 at the end of a row). Across a sequence boundary
    this is the next sequence's first token: that position's prediction is never used."""
    return torch.nn.functional.pad(tokens[:, 1:], (0, 1))


def align_to_tokens(per_position: Tensor, mb: dict) -> Tensor:
    """Per-sequence outputs of positions t-1 moved to t (the log-prob of token t, or V(tokens[<t])),
    0 at t = 0 and past each sequence's end: the protocol's layout [S, L]."""
    real = mb["attention_mask"][:, 1:] > 0
    return torch.nn.functional.pad(torch.where(real, per_position[:, :-1], 0.0), (1, 0))


def reset_rotary_positions(gpt) -> None:
    """Make megatron's RoPE follow the position_ids given to GPTModel.forward.

    GPTModel computes rotary embeddings for positions 0..L-1 of the row whatever position_ids say
    (they feed learned absolute embeddings only). Two hooks fix that without changing the module tree:
    one keeps the position_ids of the current forward call, the other indexes the rotary table with them
    ([L, 1, 1, d] -> [L, rows, 1, d], which megatron's RoPE application broadcasts as it is).
    Under context parallelism the position ids are this CP rank's (context_parallel.local): they index the
    whole row's table, which megatron would otherwise cut to the rank's chunks itself.
    Multi-latent attention (DeepSeek) has no model-level table: each MLA layer computes its own (a tuple with
    YaRN's attention factor), and each is indexed the same way."""
    if getattr(gpt, "position_embedding_type", None) == "mrope":
        return  # megatron's M-RoPE table is computed from the position_ids given to forward already
    rotaries = [gpt.rotary_pos_emb] if getattr(gpt, "rotary_pos_emb", None) is not None else [
        layer.self_attention.rotary_pos_emb for layer in getattr(getattr(gpt, "decoder", None), "layers", [])
        if getattr(layer.self_attention, "rotary_pos_emb", None) is not None]
    if not rotaries:
        return
    current = {}

    def keep_position_ids(module, args, kwargs):
        current["position_ids"] = args[1] if len(args) > 1 else kwargs.get("position_ids")

    def index_by_position(module, args, output):
        positions = current.get("position_ids")
        if positions is None:
            return output
        table = output[0] if isinstance(output, tuple) else output
        emb = table[:, 0, 0][positions.t()].unsqueeze(2)
        return (emb, *output[1:]) if isinstance(output, tuple) else emb

    gpt.register_forward_pre_hook(keep_position_ids, with_kwargs=True)
    for rotary in rotaries:
        rotary.cp_group = None
        rotary.register_forward_hook(index_by_position)


def empty_micro_batch(like: dict) -> dict:
    """A micro-batch of the same shape with no sequences (padding rows only): it contributes nothing."""
    empty = {k: torch.zeros_like(v) for k, v in like.items() if k in ("tokens", "position_ids", "doc_ids")}
    empty["cu_seqlens"] = segment_bounds(empty["doc_ids"])
    if "routed_experts" in like:  # no record: the routers choose for the padding themselves
        empty["routed_experts"] = torch.full_like(like["routed_experts"], -1)
    empty |= {k: v[:0] for k, v in like.items() if isinstance(v, Tensor) and k not in empty}
    return empty | {"packed": False}
