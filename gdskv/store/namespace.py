"""One namespace of a store (``PageStore.namespace``): its chunks' names and paths, presence,
recency and leases, and the quarantine of a chunk that failed verification."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from gdskv import format as fmt
from gdskv.io import batch as batchio
from gdskv.keys import store_key, store_key_run
from gdskv.store.counters import Counters
from gdskv.store.spec import NamespaceSpec

if TYPE_CHECKING:
    from gdskv.store.core import PageStore

STORE_KEY_CACHE = 1 << 16
"""How many block identities a ``Namespace`` remembers (about 10 MiB at most)."""


class Namespace:
    """One namespace of a store: its arrays, chunk paths, presence and recency."""

    def __init__(self, store: "PageStore", spec: NamespaceSpec):
        self.store = store
        self.spec = spec
        self.id = spec.namespace_id
        self.path = store.root / "ns" / self.id
        self.counters = Counters()
        self._array_dirs = {g.layer_group_id: str(self.path / f"g{g.layer_group_id}") for g in spec.groups}
        self._unusable: dict[str, tuple[int, int]] = {}
        """Chunk paths that failed verification but could not be quarantined (read-only store,
        full disk), with the (inode, mtime) they had: lookups skip them until they change."""
        self._store_keys: dict[tuple[int, bytes], tuple[bytes, str, str, str]] = {}
        """Names of recently named blocks' chunks (``_named``): a load and its check name the same
        512 blocks of a 32k-token prefix twice; one hash is enough. (A lookup hands the store
        keys to the native path, which names the chunks itself: ``store_key_run``.)"""

    def array_path(self, group: int) -> Path:
        return self.path / f"g{group}"

    def store_key(self, group: int, key: bytes) -> bytes:
        """The chunk's 32-byte identity (``gdskv.keys.store_key``)."""
        return self._named(group, key)[0]

    def _named(self, group: int, key: bytes) -> tuple[bytes, str, str, str]:
        """``(store key, directory, file name, path in the array directory)`` of a block's
        chunk, remembered for the last ``STORE_KEY_CACHE`` blocks named (then forgotten all at
        once: bounded, and never stale, since each is a pure function of the key)."""
        cached = self._store_keys.get((group, key)) if type(key) is bytes else None
        if cached is None:
            skey = store_key(self.id, group, key)
            hi, lo = fmt.chunk_index(skey)
            cached = (skey, f"{self.array_relpath(group)}/c/{hi}/0", str(lo), fmt.index_relpath(hi, lo))
            if type(key) is bytes:
                if len(self._store_keys) >= STORE_KEY_CACHE:
                    self._store_keys.clear()
                self._store_keys[(group, key)] = cached
        return cached

    def chunk_path(self, group: int, key: bytes) -> str:
        """Called per key on every lookup: plain strings, no pathlib."""
        return f"{self._array_dirs[group]}/{self._named(group, key)[3]}"

    def chunk_location(self, group: int, key: bytes) -> tuple[str, str]:
        """``(directory, file name)`` of the chunk, the directory relative to the store root
        (``ns/<id>/g<gid>/c/<hi>/0``): what ``gdskv.transfer`` opens through ``store.fs``."""
        _, rel_dir, name, _ = self._named(group, key)
        return rel_dir, name

    def chunk_nbytes(self, group: int) -> int:
        return self.spec.group(group).bytes_per_page + fmt.TRAILER_BYTES

    def chunk_relpath(self, group: int, key: bytes) -> str:
        """The chunk's path relative to the store root (``chunk_location`` joined)."""
        rel_dir, name = self.chunk_location(group, key)
        return f"{rel_dir}/{name}"

    def array_relpath(self, group: int) -> str:
        """The array directory of ``group`` relative to the store root."""
        return f"ns/{self.id}/g{group}"

    def store_key_run(self, group: int, keys: Sequence[bytes]) -> bytes:
        """The store keys of ``keys``, concatenated (``gdskv.keys.store_key_run``): how a lookup
        names the 512 chunks of a 32k-token prompt to the native path (``gdskv.io.batch``), which
        makes their paths itself."""
        return store_key_run(self.id, group, keys)

    def chunk_mtimes(self, group: int, keys: Sequence[bytes], size: int) -> list[Optional[int]]:
        """The mtime (ns) of each key's chunk where it is a regular file (never a link) of
        ``size`` bytes, else None: one native call where the batch path works, resolved beneath
        the root as ``contains_many`` resolves it. Called by ``Budget.on_published_many`` for the
        chunks a step's saves published."""
        if batchio.available():
            got = batchio.chunk_mtimes(self.store.fs.fd, self.array_relpath(group), self.store_key_run(group, keys), size)
            if got is not None:
                return got
        return [None if st is None else st.st_mtime_ns for _, st in self._chunk_stats(group, keys, size)]

    def _chunk_stats(self, group: int, keys: Sequence[bytes], size: int) -> list[tuple[str, Optional[os.stat_result]]]:
        """Per key, its chunk's path and ``lstat``, resolved beneath the root, where the chunk is a
        regular file of ``size`` bytes (else None): ``contains_many`` and ``chunk_mtimes`` where
        the native batch call is not available."""
        out: list[tuple[str, Optional[os.stat_result]]] = []
        for key in keys:
            path = self.chunk_path(group, key)
            try:
                st: Optional[os.stat_result] = self.store.fs.lstat(path)
            except OSError:
                st = None
            out.append((path, st if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == size else None))
        return out

    def contains_many(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key's chunk: a regular file (never a link) of the size a complete
        chunk has. One ``stat`` per key: cost is flat in the store's size. Payload checks
        happen at load. Where the native batch path works, the whole lookup is one call
        without the GIL, every path resolved beneath the root without following a link."""
        want = self.chunk_nbytes(group)
        if batchio.available():
            got = batchio.stat_chunks(self.store.fs.fd, self.array_relpath(group), self.store_key_run(group, keys), want)
            if got is not None:
                if self._unusable:
                    got = [ok and not self._remembered_unusable(self.chunk_path(group, k)) for ok, k in zip(got, keys)]
                return got
        return [st is not None and not (self._unusable and self._unusable.get(path) == (st.st_ino, st.st_mtime_ns))
                for path, st in self._chunk_stats(group, keys, want)]

    @property
    def holds_unusable(self) -> bool:
        """Whether a chunk that failed verification stays in place (``quarantine`` could not
        move it): presence then takes ``contains_many``'s check, not a file's size alone."""
        return bool(self._unusable)

    def _remembered_unusable(self, path: str) -> bool:
        """Whether ``path`` is a chunk that failed verification and could not be quarantined,
        unchanged since (see ``quarantine``)."""
        seen = self._unusable.get(path)
        if seen is None:
            return False
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return seen == (st.st_ino, st.st_mtime_ns)

    def contains(self, group: int, key: bytes) -> bool:
        return self.contains_many(group, [key])[0]

    def lease_many(self, group: int, keys: Sequence[bytes], lease_seconds: float = 0.0,
                   present: bool = False) -> list[bool]:
        """Refresh recency of the chunks that exist, in the order given (root first gets the
        oldest of the new stamps), and lease them to a load that is to follow: their atime is set
        ``lease_seconds`` into the future, and eviction (``gdskv.eviction``, in any process)
        leaves a chunk alone while its atime lies ahead. Per key, whether it was set: False when
        the chunk was not there at that moment (then it must not be promised). ``present``:
        also False unless the chunk is one ``contains_many`` would count (a regular file of the
        chunk's size, not one remembered unusable), so a lookup asks and leases in one pass.
        Called by connectors' lookups (mtime = recency, atime = lease; reads never move an atime
        forward, so a lease is only ever set here)."""
        now = time.time_ns()
        lease = int(lease_seconds * 1e9)
        fs = self.store.fs
        want = self.chunk_nbytes(group) if present else 0
        out = (batchio.lease_chunks(fs.fd, self.array_relpath(group), self.store_key_run(group, keys), now + lease, now,
                                    bool(lease), want) if batchio.available() else None)
        if out is None:
            out = self._lease_each(group, keys, now, lease, want)
        if present and self._unusable:
            out = [ok and not self._remembered_unusable(self.chunk_path(group, k)) for ok, k in zip(out, keys)]
        touched = getattr(self.store.budget, "on_touched", None)
        if touched is not None and any(out):
            hit = [i for i, ok in enumerate(out) if ok]
            touched(self, group, [keys[i] for i in hit], [now + i for i in hit], now + lease)
        return out

    def _lease_each(self, group: int, keys: Sequence[bytes], now: int, lease: int, want: int = 0) -> list[bool]:
        """``lease_many``'s times set key by key through the confined store (no native path)."""
        out = []
        fs = self.store.fs
        for i, key in enumerate(keys):
            path = self.chunk_path(group, key)
            try:
                fs.utime(path, ns=(now + lease + i, now + i))
                if not lease and not want:
                    out.append(True)
                    continue
                # an evictor may have renamed the chunk aside between the name's lookup and the
                # times landing; it is ours only if it is still there under its name with them
                st = fs.lstat(path)
                out.append((not lease or st.st_atime_ns >= now + lease)
                           and (not want or (stat.S_ISREG(st.st_mode) and st.st_size == want)))
            except OSError:
                out.append(False)
        return out

    def touch_many(self, group: int, keys: Sequence[bytes], lease_seconds: float = 0.0) -> int:
        """``lease_many``, counting the chunks touched."""
        return sum(self.lease_many(group, keys, lease_seconds))

    def remove(self, group: int, key: bytes) -> bool:
        """Unlink ``key``'s chunk of layer group ``group``; False when it was not there. Only
        for a namespace its caller owns (the demo): eviction removes chunks its own way."""
        try:
            self.store.fs.unlink(self.chunk_path(group, key))
            return True
        except FileNotFoundError:
            return False

    def quarantine(self, group: int, path: str, reason: str, announce: bool = True) -> Optional[str]:
        """Move a chunk that failed verification out of the hierarchy (``PageStore.quarantine``,
        which logs the move unless ``announce`` is False); never deletes it, never raises. Where
        it cannot be moved (read-only store, full disk) it stays, is counted
        (``quarantine_failed``) and is skipped by lookups until it changes. Called by
        ``gdskv.transfer`` on a bad load and by ``gdskv verify --repair``."""
        dest = self.store.quarantine(self.id, group, path, reason, announce)
        if dest is None:
            if self.store.fs.alive and os.path.lexists(path):
                self.counters.add("quarantine_failed")
                try:
                    st = self.store.fs.lstat(path)
                    self._unusable[path] = (st.st_ino, st.st_mtime_ns)
                except OSError:
                    pass
            return None
        self._unusable.pop(path, None)
        self.counters.add("quarantined")
        self.counters.add(f"quarantined_{reason}")  # corrupt chunks by reason (gdskv.metrics)
        return dest

