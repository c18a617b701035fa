"""The host tier's side of loads and saves: entries borrowed, buffers reserved, pages kept.

``KvService.load_many`` borrows a step's hits and reserves buffers for its disk reads,
``save_many`` reserves buffers for its saves; when a slice finishes, ``_keep`` turns the filled
buffers into entries (write-through on save, fill on load) and gives the rest back.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from gdskv.copies import payload_nbytes
from gdskv.hosttier import Borrowed, Put, Reserved

log = logging.getLogger(__name__)


class HostKeeping:
    """The host-tier methods of ``KvService``, which holds their state (``gdskv.service.core``)."""

    def _borrow_many(self, rank: int, group: int, keys: list[bytes], sizes: list[Optional[int]]) -> list[Optional[Borrowed]]:
        """The host tier's entries for a step's pages of ``sizes`` bytes each (``payload_nbytes``
        of their segments; only entries of exactly that size), lent until released; a None is a
        miss, counted (the caller reads the disk)."""
        lents = self.host.borrow_many([(rank, group, key) for key in keys], sizes)
        misses = lents.count(None)
        if misses:
            self._count(host_misses=misses)
            self.namespaces[rank].counters.add("host_misses", misses)
        return lents

    def _reserve_many(self, rank: int, group: int, keys: list[bytes], sizes: list[Optional[int]],
                      saving: bool = False) -> list[Optional[Reserved]]:
        """Host-tier buffers for a step's pages about to be read from the disk or saved (the
        transfer copies each payload there in the pass that copies it into the page, or seals it:
        ``PageTransfer.load_pages`` / ``save_pages``); a None where the tier holds the page
        already, it does not fit (for saves: ``HostTier.reserve_many``'s ``saving``), or its segments
        cannot be copied in place (size None)."""
        try:
            return self.host.reserve_many([(rank, group, key) for key in keys], sizes, saving)
        except Exception as e:  # never into the serving loop: the pages are only not kept
            log.warning("gdskv: no host-tier buffers for %d pages: %s", len(keys), e)
            return [None] * len(keys)

    def _keep(self, rank: int, group: int, pages: list[tuple[bytes, list[Any], Optional[Reserved], bool]],
              skipped: list[Optional[Reserved]]) -> list[tuple[Put, int]]:
        """The host tier's side of a finished slice, ``(key, segments, slot, ok)`` per page (ok:
        LOADED, or PUBLISHED): an ok page's reserved buffer, which the transfer filled with the
        payload it read or wrote, becomes its entry, and an ok page without one is copied in;
        every other buffer, the skipped pages' too, is given back. The puts and their bytes,
        for ``_count_puts``."""
        puts: list[tuple[Put, int]] = []
        commits: list[Reserved] = []
        aborts = [slot for slot in skipped if slot is not None]
        for key, segments, slot, ok in pages:
            if slot is not None:
                (commits if ok else aborts).append(slot)
            elif ok and self.host is not None:
                puts.append(self._fill(key=(rank, group, key), segments=segments))
        if commits or aborts:
            sizes = [slot.buf.numel() for slot in commits] + [0] * len(aborts)
            puts += zip(self.host.settle_many(commits, aborts), sizes)
        return puts

    def _fill(self, key: tuple[int, int, bytes], segments: list[Any]) -> tuple[Put, int]:
        """Copy a page into the host tier (a save just published it; a load just verified it),
        on the transfer's thread before the caller sees the page done, so it is still unchanged;
        the put and the page's bytes, for ``_count_puts``. Never raises: a page not taken is only
        a later miss."""
        size = payload_nbytes(segments) or 0
        try:
            return self.host.put(key, segments), size
        except Exception as e:
            log.warning("gdskv: a page was not copied into the host tier: %s", e)
            return Put(), size
