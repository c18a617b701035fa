"""Lookups: how much of a request's prefix every layer group and TP shard holds, leased.

``KvService.lookup`` (engines whose blocks gdskv keys: TensorRT-LLM, vLLM, the reference
engine) and ``held`` / ``touch`` (engines that name blocks themselves: MAX),
called by the connectors' schedulers. A lookup's served chunks are leased against eviction in
every process until the load that follows.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from gdskv.planner import Lookup, Salt, lookup_needs, plan_lookup, plan_lookup_window_aware


class Lookups:
    """The lookup methods of ``KvService``, which holds their state (``gdskv.service.core``)."""

    def stored(self, group: int, keys: Sequence[bytes], lease: bool = False) -> list[bool]:
        """For each key, whether every TP shard's chunk of it is in the store (layer group
        ``group``). A shard is asked only about keys the shards before it hold. ``lease``: lease
        what is found in the same pass (``Namespace.lease_many(present=True)``): a lookup's
        presence checks and leases cost one path walk per chunk, not two, and nothing can be
        evicted between the check and the lease."""
        if not self.active:
            return [False] * len(keys)
        present = [True] * len(keys)
        for ns in self.namespaces:
            todo = [i for i, p in enumerate(present) if p]
            if not todo:
                break
            asked = [keys[i] for i in todo]
            found = ns.lease_many(group, asked, self.lease_seconds, present=True) if lease else ns.contains_many(group, asked)
            for i, there in zip(todo, found):
                present[i] = there
        return present

    def _stored_dense(self, index: int, keys: Sequence[bytes]) -> list[bool]:
        return self.stored(self.group_ids[index], keys)

    def _stored_leased(self, index: int, keys: Sequence[bytes]) -> list[bool]:
        return self.stored(self.group_ids[index], keys, lease=True)

    def _lookup_stored(self) -> Callable[[int, Sequence[bytes]], list[bool]]:
        """What a lookup asks (by group index): the local store, and for what misses there the
        remote tier, reading through into the local store, all within one ``remote.timeout``."""
        if self.remote is None or not self.active:
            return self._stored_dense
        remote, deadline = self.remote, time.monotonic() + self.remote.rc.timeout
        return lambda index, keys: remote.stored(self.namespaces, self.group_ids[index], keys, deadline)

    def lookup(self, tokens: Sequence[int], cache_salt: Salt, num_computed_tokens: int = 0,
               window_aware: bool = False) -> Lookup:
        """How many of ``tokens`` beyond the ``num_computed_tokens`` the engine holds the store
        serves (``Lookup.num_new_tokens``; full blocks only, never the last token), with every
        served chunk of every group and shard leased: in the same pass as the presence checks
        (``_stored_leased``), or, with a remote tier or ``window_aware``, after them, planned
        again, once, when a lease fails. ``window_aware``: ``plan_lookup_window_aware`` (a
        sliding group needs, and leases, only the blocks inside its window before the served
        length)."""
        stored = self._lookup_stored()
        t0 = time.perf_counter()
        for attempt in (0, 1):
            if window_aware:
                found = plan_lookup_window_aware(tokens, cache_salt, self.tokens_per_block, num_computed_tokens,
                                                 self.windows, stored)
                leased = self.lease_per_group([[found.keys[o] for o in r] for r in lookup_needs(found, self.windows)])
            elif self.remote is None and self.active:  # asked and leased in one pass
                found = plan_lookup(tokens, cache_salt, self.tokens_per_block, num_computed_tokens, len(self.group_ids),
                                    self._stored_leased)
                leased = True
            else:
                found = plan_lookup(tokens, cache_salt, self.tokens_per_block, num_computed_tokens, len(self.group_ids),
                                    stored)
                leased = self.lease(found.keys[found.first_block:found.end_block])
            if leased:
                break
            self._count(lease_replans=1)
            if attempt:  # the second plan's lease failed too: promise nothing rather than a miss
                found = Lookup(found.keys, found.first_block, found.first_block, num_computed_tokens, self.tokens_per_block)
        self._count(lookups=1, lookup_tokens=len(tokens), matched_tokens=found.num_new_tokens)
        if self.active:
            shared = self.namespace.counters  # what `gdskv stats` sums across processes
            shared.add("lookups")
            shared.add("lookup_tokens", len(tokens))
            shared.add("lookup_matched_tokens", found.num_new_tokens)
            self._dirty = True
            if self.metrics is not None:
                self.metrics.observe("lookup", self.namespace, time.perf_counter() - t0)
        return found

    def lease_per_group(self, keys_by_group: Sequence[Sequence[bytes]]) -> bool:
        """Like ``lease``, with keys per group (index into ``group_ids``); False when one was gone."""
        ok = True
        for ns in self.namespaces:
            for g, keys in zip(self.group_ids, keys_by_group):
                if keys:
                    ok = all(ns.lease_many(g, list(keys), lease_seconds=self.lease_seconds)) and ok
        return ok

    def lease(self, keys: Sequence[bytes]) -> bool:
        """Lease ``keys``' chunks (every group, every shard) to the load that follows; False when
        one was gone by then."""
        if not keys:
            return True
        ok = True
        for ns in self.namespaces:
            for g in self.group_ids:
                ok = all(ns.lease_many(g, list(keys), lease_seconds=self.lease_seconds)) and ok
        return ok

    def held(self, group: int, keys: Sequence[bytes], shard: int, lease: bool = False,
             deadline: Optional[float] = None) -> list[bool]:
        """For each key, whether TP shard ``shard``'s chunk of it (layer group ``group``) is in the
        store; with ``lease``, also leased to a load that follows (``lease_seconds``, respected by
        eviction in any process; False when the chunk was gone by then). For an engine that
        combines shards itself (``gdskv.planner.held_everywhere``): a replicated leaf is stored
        on shard 0 alone. With ``lease`` (a lookup) and a remote tier, keys missing locally are
        read through from the remote first, by ``deadline`` (``time.monotonic()``; default: the
        remote's ``timeout`` from now). A caller asking several groups or shards for one lookup
        passes one deadline to all, so the lookup as a whole keeps to ``timeout``."""
        if not self.active or not keys:
            return [False] * len(keys)
        ns = self.namespaces[shard]
        if lease:
            if self.remote is not None:  # a lookup: what misses locally is read through first
                self.remote.stored([ns], group, keys, deadline or time.monotonic() + self.remote.rc.timeout)
            return ns.lease_many(group, list(keys), lease_seconds=self.lease_seconds)
        return ns.contains_many(group, keys)

    def lookup_deadline(self) -> Optional[float]:
        """When a lookup starting now must be done with the remote tier (``time.monotonic()``),
        for callers that ask ``held`` several times in one lookup; None without a remote tier."""
        return time.monotonic() + self.remote.rc.timeout if self.remote is not None else None

    def touch(self, group: int, keys: Sequence[bytes], shard: int) -> int:
        """Refresh the recency of ``keys``' chunks of shard ``shard`` (root first: give the run in
        prefix order); missing keys are skipped. How many chunks were touched."""
        return self.namespaces[shard].touch_many(group, keys) if self.active else 0
