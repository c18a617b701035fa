"""Engines that name their blocks themselves (MAX's canonical hashes): which TP shards hold a
leaf's chunks, whether a block is held everywhere it must be, what an offload writes."""
from __future__ import annotations

from typing import Callable, Optional, Sequence


HolderFn = Callable[[Sequence[bytes]], list[bool]]
"""``holds(keys)``: for each key, whether one holder (a layer group's chunks on one TP shard) has it."""


def store_shards(tp_size: int, replicated: bool) -> range:
    """The TP shards whose namespaces hold a leaf's chunks: each of the ``tp_size`` shards its
    own, or shard 0 alone for a ``replicated`` leaf (every shard holds the same bytes, e.g. MLA's
    latent cache): stored once, read once."""
    return range(1) if replicated else range(tp_size)


def shard_routes(tp_size: int, replicated: bool) -> list[tuple[int, range]]:
    """``(source shard, destination shards)`` of a load of one leaf block: each shard's page from
    its own shard's chunk, or a replicated leaf's one chunk (shard 0's) into every shard."""
    return [(0, range(tp_size))] if replicated else [(r, range(r, r + 1)) for r in range(tp_size)]


def held_everywhere(keys: Sequence[bytes], holders: Sequence[HolderFn]) -> list[bool]:
    """Which of ``keys`` a lookup may report present, and so promise to the load that follows:
    those every holder (each shard that stores the leaf, ``store_shards``) holds; none without a
    holder. Positional, not a prefix: an engine that applies its own prefix rules to the answer
    (MAX) gets exactly the blocks it could load. A holder that leases what it holds (a lookup that
    promises) makes the answer "held and leased everywhere". Each holder is asked only about the
    keys the holders before it hold (on a shared file system each ask is a round trip)."""
    present = [bool(holders)] * len(keys)
    for holds in holders:
        todo = [i for i, p in enumerate(present) if p]
        if not todo:
            break
        for i, there in zip(todo, holds([keys[i] for i in todo])):
            present[i] = bool(there)
    return present


def plan_offload(keys: Sequence[bytes], stored: Sequence[bool], first_parent: Optional[bytes],
                 chained: bool = True) -> list[tuple[int, Optional[bytes]]]:
    """What an offload of one leaf's run of blocks writes: ``(position, parent key)`` of each
    block of ``keys`` (prefix order) that is not ``stored`` yet (on every shard that stores it).

    A block's parent is the block before it in the run, and the run's first block's is
    ``first_parent`` (what the engine showed earlier, or None): so prefix-aware eviction sees one
    chain however the engine splits a request into runs. A block already stored is skipped but
    still parents the block after it. A leaf whose blocks are not a chain (``chained=False``: a
    recurrent state's checkpoints) records no parents.
    """
    if len(keys) != len(stored):
        raise ValueError(f"{len(keys)} keys but {len(stored)} stored flags")
    return [(i, (keys[i - 1] if i else first_parent) if chained else None)
            for i, there in enumerate(stored) if not there]
