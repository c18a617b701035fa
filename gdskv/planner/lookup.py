"""How much of a prompt the store can serve: full blocks, contiguous, never the whole prompt,
the smallest window bounding it (``plan_lookup``), or with ``window_aware`` only the pages each
sliding group needs (``plan_lookup_window_aware``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from gdskv.keys import chain_keys
from gdskv.planner.wire import Salt, StoredFn


def max_servable_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """Most full blocks that may be served for a prompt of ``num_tokens``: at least one token is
    left for the engine to compute, so never the whole prompt."""
    return max(0, (num_tokens - 1) // tokens_per_block)


def first_live_block(end: int, window: Optional[int], tokens_per_block: int) -> int:
    """First block ordinal lying entirely inside the live window once ``end`` tokens have KV.

    A query at position ``end`` attends to ``[end - window + 1, end]`` (itself included), so the
    pages it still needs hold positions ``>= end - window + 1``; a block is live when all of its
    tokens are. ``None`` (full attention) keeps every block live.
    """
    if window is None:
        return 0
    lo = end - window + 1
    return max(0, -(-lo // tokens_per_block))


def contiguous_hits(present: Sequence[Sequence[bool]], first: int = 0) -> int:
    """Length of the run of ordinals from ``first`` that every list in ``present`` holds.

    ``present[j][i]`` says whether holder ``j`` (a layer group on a TP shard) holds block
    ordinal ``first + i``; the run stops at the first ordinal any holder misses. Returns the
    ordinal one past the run (``first`` when nothing is held).
    """
    if len(present) == 1:  # one holder (the common case): a plain scan, no per-ordinal all()
        for i, held in enumerate(present[0]):
            if not held:
                return first + i
        return first + len(present[0])
    for i, held in enumerate(zip(*present)):
        if not all(held):
            return first + i
    return first + min((len(p) for p in present), default=0)


@dataclass(frozen=True)
class Lookup:
    """The answer to "how much of this prompt can the store serve": blocks ``[first_block,
    end_block)`` of ``keys``; ``num_new_tokens`` is what ``get_num_new_matched_tokens`` returns."""

    keys: tuple[bytes, ...]
    first_block: int
    end_block: int
    num_computed_tokens: int
    tokens_per_block: int

    @property
    def num_new_tokens(self) -> int:
        return max(0, self.end_block * self.tokens_per_block - self.num_computed_tokens)


def plan_lookup(
    tokens: Sequence[int],
    cache_salt: Salt,
    tokens_per_block: int,
    num_computed_tokens: int,
    num_groups: int,
    stored: StoredFn,
) -> Lookup:
    """Decide how many prompt tokens the store serves beyond the ``num_computed_tokens`` the
    engine already holds on the device.

    The device prefix is not looked up. A device prefix that ends inside a block is not extended
    (loading that whole block would overwrite a page the engine may share), so the answer is 0.
    """
    keys = tuple(chain_keys(tokens, tokens_per_block, cache_salt))
    limit = max_servable_blocks(len(tokens), tokens_per_block)
    first = num_computed_tokens // tokens_per_block
    if num_computed_tokens % tokens_per_block or first >= limit:
        return Lookup(keys, first, first, num_computed_tokens, tokens_per_block)
    end = limit
    for g in range(num_groups):  # each group is asked only about the run the others still hold
        end = contiguous_hits([stored(g, keys[first:end])], first)
        if end == first:
            break
    return Lookup(keys, first, end, num_computed_tokens, tokens_per_block)


# --- window-aware serving (opt-in: ``window_aware = true``) ------------------------------------------
#
# The default lookup stops at the first block ANY layer group misses, so a sliding group (which
# keeps only its window) bounds the served prefix by the smallest window. A sliding group with
# window W needs, to resume computing at token L, only the pages holding tokens [L - W, L): a query
# at position p >= L attends to [p - W + 1, p]. With the option on, the served prefix is the
# largest block boundary L such that every full-attention group holds every block below L and
# every sliding group holds the blocks intersecting [L - W, L); loads fill only those pages, and a
# sliding group saves only blocks some later lookup of this request's tokens could need.

def window_blocks(end_block: int, window: Optional[int], tokens_per_block: int, first: int = 0) -> range:
    """Block ordinals (from ``first``) a layer group needs in its pages so that computation can
    resume exactly at token ``L = end_block * tokens_per_block``: every ordinal below
    ``end_block`` under full attention (``window`` None), else those intersecting ``[L - W, L)``
    (the first holds token ``max(0, L - W)``, W need not be a multiple of the block size)."""
    if window is None:
        return range(first, max(first, end_block))
    lo = max(0, end_block * tokens_per_block - window) // tokens_per_block
    return range(max(first, lo), max(first, end_block))


def plan_lookup_window_aware(
    tokens: Sequence[int],
    cache_salt: Salt,
    tokens_per_block: int,
    num_computed_tokens: int,
    windows: Sequence[Optional[int]],
    stored: StoredFn,
) -> Lookup:
    """``plan_lookup`` with window-aware serving: blocks ``[first, end)`` where ``end`` is the
    largest ordinal (at most ``max_servable_blocks``) such that every group ``g`` (index into
    ``windows``, as ``stored`` is asked) holds ``window_blocks(end, windows[g], ...)``. Full
    attention groups bound ``end`` by their contiguous run; a sliding group may miss blocks before
    its window. Without a sliding group this is ``plan_lookup``."""
    keys = tuple(chain_keys(tokens, tokens_per_block, cache_salt))
    limit = max_servable_blocks(len(tokens), tokens_per_block)
    first = num_computed_tokens // tokens_per_block
    none = Lookup(keys, first, first, num_computed_tokens, tokens_per_block)
    if num_computed_tokens % tokens_per_block or first >= limit:
        return none
    end = limit
    for g, w in enumerate(windows):  # full attention: the contiguous run bounds the prefix
        if w is None:
            end = contiguous_hits([stored(g, keys[first:end])], first)
            if end == first:
                return none
    sliding = [g for g, w in enumerate(windows) if w is not None]
    if not sliding:
        return Lookup(keys, first, end, num_computed_tokens, tokens_per_block)
    # ask each sliding group only about blocks some candidate end could need
    base = {g: window_blocks(first + 1, windows[g], tokens_per_block, first).start for g in sliding}
    present = {g: stored(g, keys[base[g]:end]) for g in sliding}
    for b in range(end, first, -1):
        if all(all(present[g][o - base[g]] for o in window_blocks(b, windows[g], tokens_per_block, first)) for g in sliding):
            return Lookup(keys, first, b, num_computed_tokens, tokens_per_block)
    return none


def lookup_needs(lookup: Lookup, windows: Sequence[Optional[int]]) -> list[range]:
    """Per group index: the block ordinals a window-aware lookup's promise loads (and leases)."""
    tpb = lookup.tokens_per_block
    if lookup.end_block <= lookup.first_block:
        return [range(0) for _ in windows]
    return [window_blocks(lookup.end_block, w, tpb, lookup.first_block) for w in windows]


def window_keep_from(num_tokens: int, window: Optional[int], tokens_per_block: int) -> int:
    """First block ordinal a sliding group saves under window-aware serving, for a request of
    ``num_tokens`` tokens: the first block a lookup of these tokens (served up to
    ``max_servable_blocks``) or of any longer prompt sharing them could need. A block before it
    ends at least W tokens before the request's last full block. 0 for full attention."""
    if window is None:
        return 0
    return window_blocks(max_servable_blocks(num_tokens, tokens_per_block), window, tokens_per_block).start


def loads_async(lookup: Lookup, bytes_per_block: int, min_bytes: Optional[int], window_aware: bool) -> bool:
    """Whether a hit's load is big enough to take out of the forward pass: at least ``min_bytes``
    (``async_load_min_bytes``; None: never) of ``bytes_per_block`` (every group's page of one
    block, this rank's) each. A window-aware lookup always loads in the forward pass (its
    promise covers only the blocks each window needs). Called by the TensorRT-LLM scheduler at
    each lookup."""
    if min_bytes is None or window_aware or lookup.end_block <= lookup.first_block:
        return False
    return (lookup.end_block - lookup.first_block) * bytes_per_block >= min_bytes
