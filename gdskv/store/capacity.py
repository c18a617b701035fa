"""The byte budget a store accepts (``PageStore.budget``), as the transfer layer sees it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from gdskv.store.namespace import Namespace


class CapacityBudget(Protocol):
    """What a store's byte budget does for the transfer layer (``gdskv.eviction.Budget``
    implements it; ``install_budget`` hands it to ``PageStore.budget`` at bring-up).
    ``PageTransfer`` calls ``admit`` before a save writes (False: drop the save),
    ``on_publishing`` just before its write and rename, ``on_published`` after the rename,
    ``pin``/``unpin`` around every load."""

    def admit(self, ns: "Namespace", group: int, nbytes: int, parent: Optional[bytes] = None) -> bool: ...

    def on_publishing(self, ns: "Namespace", group: int, chunks: Sequence[tuple[bytes, Optional[bytes]]], nbytes: int) -> None: ...

    def on_published(self, ns: "Namespace", group: int, key: bytes, parent: Optional[bytes], nbytes: int) -> None: ...

    def pin(self, path: str) -> None: ...

    def unpin(self, path: str) -> None: ...

    # optional: ``on_touched(ns, group, keys, mtimes, lease_until_ns)`` after ``Namespace.lease_many``
