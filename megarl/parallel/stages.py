"""How many decoder layers each pipeline stage holds: megatron-core's uneven first/last stages.

megatron-core's rule (TransformerConfig's num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage):
the first and the last stage hold the counts given (each >= 1 when given), the stages between them split
the remaining layers evenly, and every stage holds at least one layer; with virtual pipeline stages every
stage's count is split evenly over its chunks. Nothing given: PP must divide the layers (the engine never picks
a split itself). 61 layers over PP 8, for example: first 5, last 8, six middle stages of 8; 94 over PP 16:
first 5, last 5, fourteen of 6.

default_first_last is the split the planner (`python -m megarl.plan`) plans with when none is given, and the one
the error for a PP that does not divide the layers suggests: the stages between the first and the last get
ceil(layers / PP) each, the first and the last the rest, the first the larger half (the last stage also holds
the output layer and the loss). 61 over PP 8: 7, 8 x 6, 6; over PP 16: 3, 4 x 14, 2; 94 over PP 4: 23, 24,
24, 23; over PP 16: 5, 6 x 14, 5.

Pure Python (no megatron import): the config check runs it before any model or process group exists.
"""

from __future__ import annotations


def stage_layers(num_layers: int, pp: int, first: int = 0, last: int = 0, vpp: int = 1,
                 keys: str = "parallel") -> tuple[int, ...]:
    """The decoder layers of each pipeline stage, in stage order. first/last: 0 = not set (an even share).
    Raises ValueError naming the keys under `keys` (e.g. 'actor.parallel') that make the split impossible."""
    given = f"{keys}.pp_first_stage_layers={first}, {keys}.pp_last_stage_layers={last}"
    if first < 0 or last < 0:
        raise ValueError(f"{given}: must be >= 0 (0 = an even share)")
    if (first or last) and pp < 2:
        raise ValueError(f"{given}: uneven pipeline stages need {keys}.pp > 1 (got {pp})")
    middle = pp - bool(first) - bool(last)
    rest = num_layers - first - last
    if not (first or last):
        if pp > num_layers:
            raise ValueError(f"{keys}.pp={pp} is more pipeline stages than num_hidden_layers={num_layers}")
        if num_layers % pp:
            raise ValueError(f"{keys}.pp={pp} does not divide num_hidden_layers={num_layers}: set "
                             f"{keys}.pp_first_stage_layers and/or {keys}.pp_last_stage_layers (uneven stages; "
                             f"e.g. {suggested_keys(num_layers, pp, keys)})")
        stages = (num_layers // pp,) * pp
    elif middle == 0 and rest != 0 or middle > 0 and (rest < middle or rest % middle):
        between = "no stage between them" if middle == 0 else f"{middle} stage(s) between them"
        raise ValueError(f"{given} with {keys}.pp={pp}: the other {rest} of num_hidden_layers={num_layers} do not "
                         f"split evenly into at least one layer per stage over the {between}")
    else:
        share = rest // middle if middle else 0
        stages = (first or share,) + (share,) * (pp - 2) + (last or share,)
    if vpp > 1 and any(count % vpp for count in stages):
        raise ValueError(f"{keys}.vpp={vpp} must divide every stage's layers {stages} ({given}, {keys}.pp={pp}, "
                         f"num_hidden_layers={num_layers})")
    return stages


def default_first_last(num_layers: int, pp: int) -> tuple[int, int]:
    """(first, last) stage layer counts for `pp` stages of `num_layers` (module docstring); (0, 0) when PP divides
    the layers. Raises ValueError when there are more stages than layers."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} is more pipeline stages than num_hidden_layers={num_layers}")
    if num_layers % pp == 0:
        return 0, 0
    share = -(-num_layers // pp)
    while num_layers - (pp - 2) * share < 2:  # the first and the last keep at least one layer each
        share -= 1
    rest = num_layers - (pp - 2) * share
    return rest - rest // 2, rest // 2


def suggested_keys(num_layers: int, pp: int, keys: str = "parallel") -> str:
    """The config overrides that give default_first_last's split, e.g. 'actor.parallel.pp_first_stage_layers=7
    actor.parallel.pp_last_stage_layers=6'."""
    first, last = default_first_last(num_layers, pp)
    return f"{keys}.pp_first_stage_layers={first} {keys}.pp_last_stage_layers={last}"
