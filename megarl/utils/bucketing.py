"""A stream of sized items cut into buckets of a size budget: the safetensors shards of an export, the buckets of a
weight sync, the resharder's transfers."""

from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def buckets_by_size(sized: Iterable[tuple[T, int]], limit: int) -> Iterator[list[T]]:
    """The items of (item, size) pairs, consumed lazily and in order, in buckets whose sizes add up to at most
    `limit`: an item that would pass it starts the next bucket; one larger than `limit` is a bucket alone."""
    bucket, total = [], 0
    for item, size in sized:
        if bucket and total + size > limit:
            yield bucket
            bucket, total = [], 0
        bucket.append(item)
        total += size
    if bucket:
        yield bucket
