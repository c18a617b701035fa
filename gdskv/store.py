"""The store: a Zarr v3 hierarchy of KV pages on a local (or shared) file system.

``<root>/zarr.json``                 root group; attribute ``gdskv`` marks a gdskv store
``<root>/ns/<ns_id>/zarr.json``      one group per namespace; attribute ``gdskv_namespace``
``<root>/ns/<ns_id>/g<gid>/``        one uint8 array per layer group, one chunk per block
``<root>/.gdskv/quarantine/``        chunks that failed verification, moved aside
``<root>/.gdskv/stats/``             per-process counter files (``gdskv stats`` sums them)
``<root>/.gdskv/lock``               advisory lock for metadata changes (never the data path)

``.gdskv`` is the one entry plain zarr does not recognise (``tree()`` warns about it once).

The store is the source of truth: presence is a file, recency is the file's mtime, and nothing
else has to be rebuilt after a restart or shared with another process. Page bytes never go through
Zarr's codec pipeline: ``gdskv.transfer`` writes and reads chunk files directly, in a layout that
plain ``zarr`` reads (``arr[hi, :bytes_per_page, lo]`` is the page; see FORMAT.md).

Called by connectors at bring-up (``PageStore.open``, ``store.namespace(spec)``), by the planner's
lookups (``contains_many``), by the transfer layer (``chunk_path``, ``quarantine``), and by the CLI.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import stat
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence

import zarr
from zarr.storage import MemoryStore

from gdskv import format as fmt
from gdskv.confined import ConfinedDir
from gdskv.io import batch as batchio
from gdskv.keys import store_key, store_key_run

log = logging.getLogger(__name__)

STORE_ATTR = "gdskv"
NAMESPACE_ATTR = "gdskv_namespace"
PRIVATE_DIR = ".gdskv"
NAMESPACE_ID = re.compile(r"^[0-9a-f]{16}$")
GROUP_DIR = re.compile(r"^g(0|[1-9][0-9]{0,9})$")
MAX_PAGE_BYTES = (1 << 32) - 1
_MAX_INT = (1 << 31) - 1


class StoreError(RuntimeError):
    """The path is not usable as a gdskv store (the message says why)."""


@dataclass(frozen=True)
class GroupSpec:
    """Page geometry of one layer group, as far as it decides KV compatibility."""

    layer_group_id: int
    bytes_per_page: int
    layer_ids: tuple[int, ...]
    window_size: Optional[int] = None


@dataclass(frozen=True)
class NamespaceSpec:
    """Everything that makes KV incompatible. Equal specs share a namespace; any difference
    (model, dtype, page geometry, TP shard, format version) is another namespace, never a wrong load."""

    model: str
    dtype: str
    tokens_per_block: int
    groups: tuple[GroupSpec, ...]
    tp_rank: int = 0
    tp_size: int = 1
    extra: tuple[tuple[str, str], ...] = ()
    format_version: int = fmt.FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = [asdict(g) | {"layer_ids": list(g.layer_ids)} for g in self.groups]
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Any) -> "NamespaceSpec":
        """The spec a namespace's metadata describes. Every value is checked before use (types,
        ranges, unique layer groups): ``ValueError`` says which one is bad. Called by
        ``PageStore.namespaces`` on every namespace found on disk."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"namespace metadata: {what}")

        def count(v: Any, lo: int, hi: int = _MAX_INT) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        need(isinstance(d, dict), "not an object")
        need(isinstance(d.get("model"), str) and isinstance(d.get("dtype"), str), "model and dtype must be strings")
        need(count(d.get("tokens_per_block"), 1), "tokens_per_block must be a positive integer")
        raw = d.get("groups")
        need(isinstance(raw, list) and len(raw) > 0, "groups must be a non-empty list")
        groups = []
        for g in raw:
            need(isinstance(g, dict), "a group is not an object")
            need(count(g.get("layer_group_id"), 0), "layer_group_id must be a non-negative integer")
            need(count(g.get("bytes_per_page"), 1, MAX_PAGE_BYTES), "bytes_per_page must be a positive integer below 4 GiB")
            ids = g.get("layer_ids")
            need(isinstance(ids, list) and all(count(i, 0) for i in ids), "layer_ids must be a list of non-negative integers")
            w = g.get("window_size")
            need(w is None or count(w, 1), "window_size must be null or a positive integer")
            groups.append(GroupSpec(g["layer_group_id"], g["bytes_per_page"], tuple(ids), w))
        need(len({g.layer_group_id for g in groups}) == len(groups), "layer_group_id values must be unique")
        tp_rank, tp_size = d.get("tp_rank", 0), d.get("tp_size", 1)
        need(count(tp_size, 1) and count(tp_rank, 0, tp_size - 1 if count(tp_size, 1) else 0), "tp_rank/tp_size out of range")
        extra = d.get("extra", {})
        need(isinstance(extra, dict), "extra must be an object")
        version = d.get("format_version", fmt.FORMAT_VERSION)
        need(count(version, 0), "format_version must be an integer")
        return cls(
            model=d["model"], dtype=d["dtype"], tokens_per_block=d["tokens_per_block"], groups=tuple(groups),
            tp_rank=tp_rank, tp_size=tp_size, extra=tuple(sorted((str(k), str(v)) for k, v in extra.items())),
            format_version=version,
        )

    @property
    def namespace_id(self) -> str:
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def group(self, layer_group_id: int) -> GroupSpec:
        for g in self.groups:
            if g.layer_group_id == layer_group_id:
                return g
        raise KeyError(f"namespace has no layer group {layer_group_id}")

    def with_rank(self, tp_rank: int) -> "NamespaceSpec":
        return NamespaceSpec(self.model, self.dtype, self.tokens_per_block, self.groups, tp_rank, self.tp_size, self.extra, self.format_version)

    @classmethod
    def from_layout(cls, layout: Any, model: str, tp_rank: int = 0, tp_size: int = 1, extra: Optional[dict[str, Any]] = None) -> "NamespaceSpec":
        """Derive the spec from a ``KvCacheLayout`` (ours or TensorRT-LLM's, duck-typed)."""
        groups = tuple(
            GroupSpec(int(g.layer_group_id), int(g.bytes_per_page), tuple(int(i) for i in g.layer_ids),
                      None if g.window_size is None else int(g.window_size))
            for g in layout.groups
        )
        return cls(
            model=model, dtype=str(layout.dtype).removeprefix("torch."), tokens_per_block=int(layout.tokens_per_block),
            groups=groups, tp_rank=tp_rank, tp_size=tp_size,
            extra=tuple(sorted((str(k), str(v)) for k, v in (extra or {}).items())),
        )


class Counters:
    """Thread-safe event counters of one namespace in this process (hits, misses, bytes, ...)."""

    def __init__(self) -> None:
        self._c: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._c[name]


class CapacityBudget(Protocol):
    """What a store's byte budget does for the transfer layer (``gdskv.eviction.Budget``
    implements it; ``install_budget`` hands it to ``PageStore.budget`` at bring-up).
    ``PageTransfer`` calls ``admit`` before a save writes (False: drop the save),
    ``on_published`` after its rename, ``pin``/``unpin`` around every load."""

    def admit(self, ns: "Namespace", group: int, nbytes: int, parent: Optional[bytes] = None) -> bool: ...

    def on_published(self, ns: "Namespace", group: int, key: bytes, parent: Optional[bytes], nbytes: int) -> None: ...

    def pin(self, path: str) -> None: ...

    def unpin(self, path: str) -> None: ...

    # optional: ``on_touched(ns, group, keys, mtimes, lease_until_ns)`` after ``Namespace.lease_many``


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
        try:
            self.store.fs.unlink(self.chunk_path(group, key))
            return True
        except FileNotFoundError:
            return False

    def quarantine(self, group: int, path: str, reason: str) -> Optional[str]:
        """Move a chunk that failed verification out of the hierarchy (``PageStore.quarantine``);
        never deletes it, never raises. Where it cannot be moved (read-only store, full disk) it
        stays, is counted (``quarantine_failed``) and is skipped by lookups until it changes.
        Called by ``gdskv.transfer`` on a bad load and by ``gdskv verify --repair``."""
        dest = self.store.quarantine(self.id, group, path, reason)
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


@dataclass(frozen=True)
class ArrayDir:
    """One layer group's array directory as found on disk (``ns/<ns_id>/g<group>``).
    ``namespace`` is None when the namespace's metadata is missing, malformed or does not hash
    to its directory's name: its chunks still take space (eviction sees them) but are never
    served."""

    ns_id: str
    group: int
    path: str
    namespace: Optional[Namespace]


@dataclass(frozen=True)
class ChunkEntry:
    """One entry of a chunk directory ``c/<hi>/0/`` (``lo`` None for names that are not a chunk
    index, such as temp files; ``kind`` as ``gdskv.confined.Entry``)."""

    hi: int
    lo: Optional[int]
    name: str
    path: str
    kind: str
    st: Optional[os.stat_result]

    def stat(self) -> os.stat_result:
        if self.st is None:
            raise FileNotFoundError(errno.ENOENT, "entry has no stat", self.path)
        return self.st

    @property
    def is_chunk(self) -> bool:
        """A published chunk file: a regular file named by its chunk index."""
        return self.kind == "file" and self.lo is not None


class PageStore:
    """A gdskv store at ``root``. Cheap to open; safe to open from many processes at once.

    Every change to the tree goes through ``fs`` (``gdskv.confined``): nothing outside the root
    is ever created, moved, removed or touched, whatever links the tree holds. Files are created
    with ``file_mode``, directories with ``dir_mode`` (owner-only by default)."""

    def __init__(self, root: Path, file_mode: int = 0o600, dir_mode: int = 0o700):
        self.root = root
        self.private = root / PRIVATE_DIR
        self.fs = ConfinedDir(root, file_mode, dir_mode)
        self._namespaces: dict[str, Namespace] = {}
        self._lock = threading.Lock()
        self.budget: Optional[CapacityBudget] = None
        """The byte budget, when one is configured (``gdskv.eviction.install_budget``)."""
        self._stats_name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.json"

    @classmethod
    def open(cls, path: str | os.PathLike, create: bool = True, file_mode: int = 0o600, dir_mode: int = 0o700) -> "PageStore":
        """Open the store at ``path``; with ``create``, make it when ``path`` is missing or an
        empty directory. ``StoreError`` (saying why) for anything else: a file, a non-empty
        directory that is not a gdskv store, links where the store's own directories belong,
        a root ``zarr.json`` that does not parse. Called at bring-up by connectors, the CLI,
        the demo and the benchmarks."""
        root = Path(path)
        meta = root / "zarr.json"
        if root.exists() and not root.is_dir():
            raise StoreError(f"{root} is not a directory")
        if os.path.lexists(meta):
            if not is_store(root):
                raise StoreError(f"{root} is a Zarr hierarchy but not a gdskv store (no '{STORE_ATTR}' attribute)")
        elif not create:
            raise StoreError(f"{root} is not a gdskv store (no {meta.name} with a '{STORE_ATTR}' attribute)")
        elif root.exists() and any(root.iterdir()):
            raise StoreError(f"{root} exists, is not empty and is not a gdskv store; refusing to use it")
        else:
            existed = root.exists()
            root.mkdir(parents=True, exist_ok=True, mode=dir_mode)
            if not existed:
                os.chmod(root, dir_mode)
            fresh = cls(root, file_mode, dir_mode)
            with fresh._flock():
                if not os.path.lexists(meta):
                    fresh._write_metadata("", _root_metadata())
            return cls._checked(fresh)
        store = cls(root, file_mode, dir_mode)
        return cls._checked(store)

    @classmethod
    def _checked(cls, store: "PageStore") -> "PageStore":
        root = store.root
        for name in (PRIVATE_DIR, "ns"):
            if (root / name).is_symlink() or os.path.lexists(root / name) and not (root / name).is_dir():
                raise StoreError(f"{root / name} is not a directory of this store (a link or a file); refusing to use {root}")
        version = store.attributes().get("format_version")
        if version != fmt.FORMAT_VERSION:
            raise StoreError(f"{root} has gdskv format version {version!r}; this gdskv reads {fmt.FORMAT_VERSION}")
        return store

    @classmethod
    def from_config(cls, cfg: Any, create: bool = True) -> "PageStore":
        """``open`` at the config's ``store_path`` with its ``file_mode`` / ``dir_mode``. The
        bring-up of every connector, the demo and the CLI."""
        return cls.open(cfg.store_path, create, cfg.file_mode, cfg.dir_mode)

    def attributes(self) -> dict[str, Any]:
        """The root group's ``gdskv`` attribute (``{}`` when it cannot be read)."""
        return _store_attr(self.fs) or {}

    def namespace(self, spec: NamespaceSpec) -> Namespace:
        """The namespace for ``spec``, created (group + one array per layer group) if new.
        ``OSError`` saying so when it cannot be created (full disk, read-only store, links in the
        way): connectors then serve nothing, the CLI prints one line."""
        ns_id = spec.namespace_id
        with self._lock:
            if ns_id in self._namespaces:
                return self._namespaces[ns_id]
            ns = Namespace(self, spec)
            if not _is_file(ns.path / "zarr.json") or any(not _is_file(ns.array_path(g.layer_group_id) / "zarr.json") for g in spec.groups):
                try:
                    self._create_namespace(ns)
                except OSError as e:
                    raise OSError(e.errno, f"cannot create namespace {ns.id} in {self.root}: {e.strerror or e}") from None
            self._namespaces[ns_id] = ns
            return ns

    def _create_namespace(self, ns: Namespace) -> None:
        with self._flock():
            others = [o for o in self.namespaces() if o.spec.model == ns.spec.model and o.id != ns.id and o.spec.tp_rank == ns.spec.tp_rank]
            if others:
                log.warning(
                    "gdskv: store %s has namespace(s) %s for model %r with other geometry; KV for this "
                    "configuration goes to a new namespace %s (no hits from the old ones)",
                    self.root, ", ".join(o.id for o in others), ns.spec.model, ns.id,
                )
            for rel, doc in _namespace_metadata(ns).items():
                self._write_metadata(rel, doc)

    def _write_metadata(self, rel_dir: str, doc: bytes) -> None:
        """Write a Zarr ``zarr.json`` document into ``rel_dir`` (made if missing) through
        ``fs``: never through a link, always with the store's file mode."""
        path = f"{rel_dir}/zarr.json" if rel_dir else "zarr.json"
        self.fs.write_atomic(path, doc, f"{fmt.TMP_MARK}{os.getpid()}.{time.time_ns():x}")

    def namespaces(self) -> list[Namespace]:
        """Every sound namespace on disk (including ones other processes created): metadata that
        parses, passes ``NamespaceSpec.from_json`` and hashes to its directory's name."""
        return [ns for ns, why in self._scan_namespaces() if why is None]

    def damaged_namespaces(self) -> list[tuple[str, str]]:
        """``(namespace id, why)`` of namespace directories whose metadata is missing, malformed
        or inconsistent: never served; ``gdskv info`` lists them, eviction still sees their
        chunks."""
        return [(ns_id, why) for ns_id, why in self._scan_namespaces() if why is not None]

    def _scan_namespaces(self) -> list[tuple[Any, Any]]:
        """``(Namespace, None)`` per sound namespace, ``(id, why)`` per damaged one."""
        out: list[tuple[Any, Any]] = []
        for e in sorted(self.fs.scandir("ns"), key=lambda e: e.name):
            if e.kind != "dir" or not NAMESPACE_ID.match(e.name):
                continue
            try:
                doc = json.loads(self.fs.read_small(f"ns/{e.name}/zarr.json"))
                spec = NamespaceSpec.from_json(doc["attributes"][NAMESPACE_ATTR] if isinstance(doc, dict) and isinstance(doc.get("attributes"), dict) and NAMESPACE_ATTR in doc["attributes"] else None)
            except FileNotFoundError:
                out.append((e.name, "no metadata (zarr.json)"))
                continue
            except (OSError, ValueError, UnicodeDecodeError) as err:
                out.append((e.name, str(err)))
                continue
            if spec.namespace_id != e.name:
                out.append((e.name, f"metadata describes namespace {spec.namespace_id}, not {e.name}"))
                continue
            out.append((self._namespaces.get(spec.namespace_id) or Namespace(self, spec), None))
        return out

    def arrays(self, namespaces: Optional[Sequence[Namespace]] = None) -> list[ArrayDir]:
        """Every layer-group array directory on disk (``ns/<id>/g<gid>``, real directories
        only), of ``namespaces`` (default: all, damaged namespaces included). The one walk of
        the tree: eviction, garbage collection, verification and listings start here."""
        if namespaces is not None:
            return [ArrayDir(ns.id, g.layer_group_id, str(ns.array_path(g.layer_group_id)), ns)
                    for ns in namespaces for g in ns.spec.groups]
        sound = {ns.id: ns for ns in self.namespaces()}
        out = []
        for e in sorted(self.fs.scandir("ns"), key=lambda e: e.name):
            if e.kind != "dir" or not NAMESPACE_ID.match(e.name):
                continue
            ns = sound.get(e.name)
            for g in sorted(self.fs.scandir(f"ns/{e.name}"), key=lambda g: g.name):
                if g.kind == "dir" and GROUP_DIR.match(g.name):
                    gid = int(g.name[1:])
                    owner = ns if ns is not None and any(x.layer_group_id == gid for x in ns.spec.groups) else None
                    out.append(ArrayDir(e.name, gid, f"{self.root}/ns/{e.name}/{g.name}", owner))
        return out

    def chunk_entries(self, array: ArrayDir, with_stat: bool = True) -> Iterator[ChunkEntry]:
        """Every entry of every chunk directory (``c/<hi>/0/``) of ``array``; directories that
        are links or not named as Zarr names them are skipped, never entered."""
        base = f"ns/{array.ns_id}/g{array.group}/c"
        for hi in self.fs.scandir(base):
            if hi.kind != "dir" or not hi.name.isdigit():
                continue
            hi_n = int(hi.name)
            sub = f"{base}/{hi.name}/0"
            for e in self.fs.scandir(sub, with_stat=with_stat):
                lo = int(e.name) if e.name.isdigit() else None
                yield ChunkEntry(hi_n, lo, e.name, f"{self.root}/{sub}/{e.name}", e.kind, e.st)

    def iter_chunk_files(self, namespaces: Optional[Sequence[Namespace]] = None) -> Iterator[tuple[Namespace, int, ChunkEntry]]:
        """Every published chunk file of sound ``namespaces`` (default all): ``(namespace,
        group, entry)``. Called by tests and tools that read chunks."""
        for array in self.arrays(namespaces if namespaces is not None else self.namespaces()):
            for e in self.chunk_entries(array):
                if e.is_chunk and array.namespace is not None:
                    yield array.namespace, array.group, e

    def quarantine(self, ns_id: str, group: int, path: str, reason: str) -> Optional[str]:
        """Move the entry at ``path`` (a chunk, or whatever sits where a chunk belongs: a link
        moves as a link) to ``.gdskv/quarantine/<ns_id>/g<group>/``; the destination, or None
        when it is gone or cannot be moved (logged). Never raises, never deletes."""
        name = os.path.basename(path)
        dest = f"{PRIVATE_DIR}/quarantine/{ns_id}/g{int(group)}/{name}.{reason}.{time.time_ns()}"
        try:
            self.fs.makedirs(os.path.dirname(dest))
            self.fs.rename(path, dest)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("gdskv: %s failed verification (%s) and could not be quarantined: %s", path, reason, e)
            return None
        log.warning("gdskv: quarantined chunk %s (%s) to %s", path, reason, self.fs.abspath(dest))
        return self.fs.abspath(dest)

    def flush_stats(self) -> None:
        """Write this process's counters (all namespaces) to ``stats/``, atomically; a failure
        (full disk, removed store) is logged and leaves no temp file behind."""
        data = {ns_id: ns.counters.snapshot() for ns_id, ns in self._namespaces.items()}
        if not any(data.values()):
            return
        try:
            self.fs.write_atomic(f"{PRIVATE_DIR}/stats/{self._stats_name}",
                                 json.dumps({"updated": time.time(), "namespaces": data}).encode(),
                                 f"{fmt.TMP_MARK}{os.getpid()}")
        except OSError as e:  # a full disk must not break serving
            log.warning("gdskv: could not write stats to %s: %s", self.private / "stats", e)

    @contextmanager
    def _flock(self) -> Iterator[None]:
        """An exclusive advisory lock on the store for metadata creation (not the data path)."""
        self.fs.makedirs(PRIVATE_DIR)
        fd = self.fs.open(f"{PRIVATE_DIR}/lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _metadata_documents(build) -> dict[str, bytes]:
    """Zarr's own ``zarr.json`` documents for a hierarchy ``build`` makes in memory (written to
    disk by ``PageStore._write_metadata``, so that zarr never writes through a link)."""
    mem = MemoryStore()
    build(zarr.open_group(store=mem, mode="w", zarr_format=3))
    return {key.rpartition("/")[0]: buf.to_bytes() for key, buf in mem._store_dict.items() if key.endswith("zarr.json")}


def _root_metadata() -> bytes:
    return _metadata_documents(lambda g: g.attrs.update({STORE_ATTR: {"format_version": fmt.FORMAT_VERSION}}))[""]


def _namespace_metadata(ns: Namespace) -> dict[str, bytes]:
    """``{relative directory: zarr.json}`` of a namespace group and its arrays."""

    def build(root: Any) -> None:
        grp = root.require_group(f"ns/{ns.id}")
        grp.attrs[NAMESPACE_ATTR] = ns.spec.to_json()
        for g in ns.spec.groups:
            shape = fmt.array_shape(g.bytes_per_page)
            grp.create_array(
                f"g{g.layer_group_id}", shape=shape, chunks=(1, shape[1], 1), dtype="uint8",
                fill_value=0, compressors=None, config={"write_empty_chunks": True},
                attributes={"gdskv_group": asdict(g) | {"layer_ids": list(g.layer_ids)},
                            "gdskv_layout": "chunk = page bytes || 128-byte trailer; see FORMAT.md"},
            )

    return {rel: doc for rel, doc in _metadata_documents(build).items() if rel.startswith("ns/")}


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _store_attr(fs: ConfinedDir) -> Optional[dict[str, Any]]:
    """The root ``zarr.json``'s ``gdskv`` attribute when it is a regular file that parses into
    an object, else None."""
    try:
        doc = json.loads(fs.read_small("zarr.json"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    value = attrs.get(STORE_ATTR) if isinstance(attrs, dict) else None
    return value if isinstance(value, dict) else None


def is_store(root: Path) -> bool:
    """Whether ``root`` holds a gdskv store's root ``zarr.json`` (read without following a link)."""
    try:
        fs = ConfinedDir(root)
    except OSError:
        return False
    try:
        return _store_attr(fs) is not None
    finally:
        fs.close()
