"""The training ranks' Ray placement group, placed within a bounded time or refused naming what is missing.

A placement group whose bundles no set of live nodes can hold stays pending for good on a cluster that does not grow
(a Slurm allocation, a node lost with its ranks): a group that does not fit the live nodes' total resources is
refused at once, one that fits them but not what is free now (held by other actors, or by Ray still releasing a
removed group) is given `timeout` seconds.
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group


class PlacementError(RuntimeError):
    """Ray cannot place a group's ranks; the message names the bundles, the live nodes and what is missing."""


def described(resources: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in sorted(resources.items()))


def bundles_held(total: dict[str, float], bundle: dict[str, float]) -> int:
    """How many bundles a node of `total` resources holds (a fractional GPU share on one GPU: bundles never span
    GPUs)."""
    counts = []
    for key, need in bundle.items():
        have = total.get(key, 0.0)
        counts.append(int(have) * int(1 // need) if key == "GPU" and need < 1 else int(have // need + 1e-9))
    return min(counts, default=0)


def room(bundle: dict[str, float], strategy: str) -> tuple[int, list[dict]]:
    """How many bundles the live nodes' total resources hold under `strategy` (strict_spread: one a node), and those
    nodes."""
    nodes = [n for n in ray.nodes() if n["Alive"]]
    held = [bundles_held(n["Resources"], bundle) for n in nodes]
    return (sum(min(h, 1) for h in held) if strategy == "strict_spread" else sum(held)), nodes


def refusal(what: str, bundle: dict[str, float], count: int, strategy: str, nodes: list[dict], fits: int,
            timeout: float | None = None) -> str:
    """What `what` needs and the live nodes have: the bundles missing, or (`timeout`) that they fit but were not
    placed in time."""
    need = f"{what} need {count} bundle(s) of {described(bundle)} (trainer.placement={strategy})"
    if timeout is None:
        short = count - fits
        why = (f"Ray's live nodes hold {fits}: {short} bundle(s) missing, "
               f"{described({k: v * short for k, v in bundle.items()})}")
    else:
        why = (f"Ray's live nodes could hold them but did not place them within {timeout:g} s (held by other actors? "
               f"free now: {described({k: ray.available_resources().get(k, 0.0) for k in bundle})})")
    live = "; ".join(f"{n['NodeManagerAddress']} (node {n['NodeID']}): "
                     f"{described({k: n['Resources'].get(k, 0.0) for k in bundle})}"
                     for n in nodes) or "none"
    return f"{need}, and {why}. Live nodes: {live}"


def place(bundle: dict[str, float], count: int, strategy: str, what: str, timeout: float = 300.0) -> PlacementGroup:
    """`count` bundles for `what` (e.g. 'the actor ranks'), placed; PlacementError naming the live nodes and the
    resources missing at once where they cannot hold them, or after `timeout` s where they could but did not."""
    fits, nodes = room(bundle, strategy)
    if fits < count:
        raise PlacementError(refusal(what, bundle, count, strategy, nodes, fits))
    pg = placement_group([dict(bundle) for _ in range(count)], strategy=strategy.upper())
    ready, deadline = pg.ready(), time.monotonic() + timeout
    while not ray.wait([ready], timeout=1.0)[0]:
        fits, nodes = room(bundle, strategy)  # a node lost meanwhile
        if fits < count or time.monotonic() > deadline:
            ray.util.remove_placement_group(pg)
            raise PlacementError(refusal(what, bundle, count, strategy, nodes, fits,
                                         None if fits < count else timeout))
    return pg
