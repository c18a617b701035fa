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

import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import zarr

from gdskv import format as fmt
from gdskv.keys import store_key

log = logging.getLogger(__name__)

STORE_ATTR = "gdskv"
NAMESPACE_ATTR = "gdskv_namespace"
PRIVATE_DIR = ".gdskv"


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
    def from_json(cls, d: dict[str, Any]) -> "NamespaceSpec":
        groups = tuple(
            GroupSpec(g["layer_group_id"], g["bytes_per_page"], tuple(g["layer_ids"]), g.get("window_size"))
            for g in d["groups"]
        )
        return cls(
            model=d["model"], dtype=d["dtype"], tokens_per_block=d["tokens_per_block"], groups=groups,
            tp_rank=d.get("tp_rank", 0), tp_size=d.get("tp_size", 1),
            extra=tuple(sorted((str(k), str(v)) for k, v in d.get("extra", {}).items())),
            format_version=d.get("format_version", fmt.FORMAT_VERSION),
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


class Namespace:
    """One namespace of a store: its arrays, chunk paths, presence and recency."""

    def __init__(self, store: "PageStore", spec: NamespaceSpec):
        self.store = store
        self.spec = spec
        self.id = spec.namespace_id
        self.path = store.root / "ns" / self.id
        self.counters = Counters()
        self._array_dirs = {g.layer_group_id: str(self.path / f"g{g.layer_group_id}") for g in spec.groups}

    def array_path(self, group: int) -> Path:
        return self.path / f"g{group}"

    def store_key(self, group: int, key: bytes) -> bytes:
        return store_key(self.id, group, key)

    def chunk_path(self, group: int, key: bytes) -> str:
        """Called per key on every lookup: plain strings, no pathlib."""
        return f"{self._array_dirs[group]}/{fmt.chunk_relpath(self.store_key(group, key))}"

    def chunk_nbytes(self, group: int) -> int:
        return self.spec.group(group).bytes_per_page + fmt.TRAILER_BYTES

    def contains_many(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key's chunk, with the size a complete chunk has.

        One ``stat`` per key: cost is flat in the store's size. Payload checks happen at load.
        """
        want = self.chunk_nbytes(group)
        out = []
        for key in keys:
            try:
                out.append(os.stat(self.chunk_path(group, key)).st_size == want)
            except OSError:
                out.append(False)
        return out

    def contains(self, group: int, key: bytes) -> bool:
        return self.contains_many(group, [key])[0]

    def touch_many(self, group: int, keys: Sequence[bytes], lease_seconds: float = 0.0) -> int:
        """Refresh recency of the chunks that exist, in the order given (root first gets the
        oldest of the new stamps). Missing keys are skipped. Returns how many were touched.

        ``lease_seconds``: also lease the chunks to a load that is to follow: their atime is set
        that far into the future, and eviction (``gdskv.eviction``, in any process) leaves a chunk
        alone while its atime lies ahead. Called by connectors' lookups (mtime = recency, atime =
        lease; reads never move an atime forward, so a lease is only ever set here)."""
        now = time.time_ns()
        lease = int(lease_seconds * 1e9)
        touched = 0
        for i, key in enumerate(keys):
            try:
                os.utime(self.chunk_path(group, key), ns=(now + lease + i, now + i))
                touched += 1
            except OSError:
                pass
        return touched

    def remove(self, group: int, key: bytes) -> bool:
        try:
            os.unlink(self.chunk_path(group, key))
            return True
        except FileNotFoundError:
            return False

    def quarantine(self, group: int, path: str, reason: str) -> Optional[str]:
        """Move a chunk that failed verification out of the hierarchy; never deletes it."""
        dest_dir = self.store.private / "quarantine" / self.id / f"g{group}"
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / f"{Path(path).name}.{reason}.{time.time_ns()}"
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return None
        self.counters.add("quarantined")
        log.warning("gdskv: quarantined chunk %s (%s) to %s", path, reason, dest)
        return str(dest)


class PageStore:
    """A gdskv store at ``root``. Cheap to open; safe to open from many processes at once."""

    def __init__(self, root: Path):
        self.root = root
        self.private = root / PRIVATE_DIR
        self._namespaces: dict[str, Namespace] = {}
        self._lock = threading.Lock()
        self.budget: Optional[Any] = None
        """Set by ``gdskv.eviction`` when a byte budget is configured: ``admit``, ``on_published``,
        ``pin``/``unpin``."""
        self._stats_name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.json"

    @classmethod
    def open(cls, path: str | os.PathLike, create: bool = True) -> "PageStore":
        root = Path(path)
        meta = root / "zarr.json"
        if meta.exists():
            if not is_store(root):
                raise StoreError(f"{root} is a Zarr hierarchy but not a gdskv store (no '{STORE_ATTR}' attribute)")
        elif not create:
            raise StoreError(f"{root} is not a gdskv store (no {meta.name} with a '{STORE_ATTR}' attribute)")
        elif root.exists() and any(root.iterdir()):
            raise StoreError(f"{root} exists, is not empty and is not a gdskv store; refusing to use it")
        else:
            root.mkdir(parents=True, exist_ok=True)
            with _flock(root):
                if not meta.exists():
                    zarr.open_group(str(root), mode="a", zarr_format=3, attributes={STORE_ATTR: {"format_version": fmt.FORMAT_VERSION}})
        store = cls(root)
        version = store.attributes().get("format_version")
        if version != fmt.FORMAT_VERSION:
            raise StoreError(f"{root} has gdskv format version {version}; this gdskv reads {fmt.FORMAT_VERSION}")
        return store

    def attributes(self) -> dict[str, Any]:
        return json.loads((self.root / "zarr.json").read_text()).get("attributes", {}).get(STORE_ATTR, {})

    def namespace(self, spec: NamespaceSpec) -> Namespace:
        """The namespace for ``spec``, created (group + one array per layer group) if new."""
        ns_id = spec.namespace_id
        with self._lock:
            if ns_id in self._namespaces:
                return self._namespaces[ns_id]
            ns = Namespace(self, spec)
            if not (ns.path / "zarr.json").exists() or any(not (ns.array_path(g.layer_group_id) / "zarr.json").exists() for g in spec.groups):
                self._create_namespace(ns)
            self._namespaces[ns_id] = ns
            return ns

    def _create_namespace(self, ns: Namespace) -> None:
        with _flock(self.root):
            others = [o for o in self.namespaces() if o.spec.model == ns.spec.model and o.id != ns.id and o.spec.tp_rank == ns.spec.tp_rank]
            if others:
                log.warning(
                    "gdskv: store %s has namespace(s) %s for model %r with other geometry; KV for this "
                    "configuration goes to a new namespace %s (no hits from the old ones)",
                    self.root, ", ".join(o.id for o in others), ns.spec.model, ns.id,
                )
            grp = zarr.open_group(str(self.root), mode="a").require_group(f"ns/{ns.id}")
            grp.attrs[NAMESPACE_ATTR] = ns.spec.to_json()
            for g in ns.spec.groups:
                if (ns.array_path(g.layer_group_id) / "zarr.json").exists():
                    continue
                shape = fmt.array_shape(g.bytes_per_page)
                grp.create_array(
                    f"g{g.layer_group_id}", shape=shape, chunks=(1, shape[1], 1), dtype="uint8",
                    fill_value=0, compressors=None, config={"write_empty_chunks": True},
                    attributes={"gdskv_group": asdict(g) | {"layer_ids": list(g.layer_ids)},
                                "gdskv_layout": "chunk = page bytes || 128-byte trailer; see FORMAT.md"},
                )

    def namespaces(self) -> list[Namespace]:
        """Every namespace on disk (including ones other processes created)."""
        out = []
        base = self.root / "ns"
        if not base.is_dir():
            return out
        for d in sorted(base.iterdir()):
            try:
                attrs = json.loads((d / "zarr.json").read_text())["attributes"][NAMESPACE_ATTR]
            except (OSError, KeyError, ValueError):
                continue
            spec = NamespaceSpec.from_json(attrs)
            out.append(self._namespaces.get(spec.namespace_id) or Namespace(self, spec))
        return out

    def flush_stats(self) -> None:
        """Write this process's counters (all namespaces) to ``stats/``, atomically."""
        data = {ns_id: ns.counters.snapshot() for ns_id, ns in self._namespaces.items()}
        if not any(data.values()):
            return
        d = self.private / "stats"
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f"{self._stats_name}{fmt.TMP_MARK}{os.getpid()}"
            tmp.write_text(json.dumps({"updated": time.time(), "namespaces": data}))
            os.replace(tmp, d / self._stats_name)
        except OSError as e:  # a full disk must not break serving
            log.warning("gdskv: could not write stats to %s: %s", d, e)

    def iter_chunk_files(self, namespaces: Optional[Sequence[Namespace]] = None) -> Iterator[tuple[Namespace, int, os.DirEntry]]:
        """Every published chunk file (of ``namespaces``, default all): ``(namespace, group,
        entry)``. Skips temp files; a directory removed meanwhile (eviction, gc) is skipped too.
        Called by ``gdskv verify`` and tests."""
        for ns in self.namespaces() if namespaces is None else namespaces:
            for g in ns.spec.groups:
                for hi in _scandir_or_empty(str(ns.array_path(g.layer_group_id) / "c")):
                    for e in _scandir_or_empty(os.path.join(hi.path, "0")):
                        if e.is_file(follow_symlinks=False) and not fmt.is_temp_name(e.name):
                            yield ns, g.layer_group_id, e


def _scandir_or_empty(path: str) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_store(root: Path) -> bool:
    try:
        return STORE_ATTR in json.loads((Path(root) / "zarr.json").read_text()).get("attributes", {})
    except (OSError, ValueError):
        return False


@contextmanager
def _flock(root: Path) -> Iterator[None]:
    """An exclusive advisory lock on the store for metadata creation (not the data path)."""
    (root / PRIVATE_DIR).mkdir(exist_ok=True)
    fd = os.open(root / PRIVATE_DIR / "lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
