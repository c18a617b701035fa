"""``PageStore``: opening (or making) a store, its namespaces, quarantine, this process's stats,
the metadata lock. Its walk of the tree is ``gdskv.store.walk``'s."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional

from gdskv import format as fmt
from gdskv import jsondoc
from gdskv.confined import ConfinedDir
from gdskv.store.capacity import CapacityBudget
from gdskv.store.namespace import Namespace
from gdskv.store.spec import NamespaceSpec
from gdskv.store.tree import PRIVATE_DIR, STORE_ATTR, is_file, is_store, namespace_metadata, root_metadata, store_attr
from gdskv.store.walk import Walking

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """The path is not usable as a gdskv store (the message says why)."""


class StoreUnreadable(StoreError):
    """The path may hold a gdskv store, but this process may not read its root or its
    ``zarr.json``: the CLI's exit 1, where a path that is not a store (a damaged ``zarr.json``
    included) is a usage mistake (exit 2)."""


class PageStore(Walking):
    """A gdskv store at ``root``. Cheap to open; safe to open from many processes at once.

    Every change to the tree goes through ``fs`` (``gdskv.confined``): nothing outside the root
    is ever created, moved, removed or touched, whatever links the tree holds. Files are created
    with ``file_mode``, directories with ``dir_mode`` (owner-only by default)."""

    def __init__(self, root: Path, file_mode: int = 0o600, dir_mode: int = 0o700):
        self.root = Path(os.path.abspath(root))
        """Absolute and normalized, as ``fs`` names the root: the chunk paths built from it are
        the paths ``fs`` takes as inside the store (a relative root's would be taken as relative
        to the store, a ``..`` in it as leaving it)."""
        self.private = self.root / PRIVATE_DIR
        self.fs = ConfinedDir(self.root, file_mode, dir_mode)
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
        if _exists(meta):
            if not is_store(root):
                _why_not_a_store(root)
        elif not create:
            raise StoreError(f"{root} is not a gdskv store (no {meta.name} with a '{STORE_ATTR}' attribute)")
        elif root.exists() and not _being_made(root):
            raise StoreError(f"{root} exists, is not empty and is not a gdskv store; refusing to use it")
        else:
            existed = root.exists()
            root.mkdir(parents=True, exist_ok=True, mode=dir_mode)
            if not existed:
                os.chmod(root, dir_mode)
            fresh = cls(root, file_mode, dir_mode)
            with fresh._flock():
                if not os.path.lexists(meta):
                    fresh._write_metadata("", root_metadata())
            return cls._checked(fresh)
        store = cls(root, file_mode, dir_mode)
        return cls._checked(store)

    @classmethod
    def _checked(cls, store: "PageStore") -> "PageStore":
        """``store``, refused (``StoreError``) where its own directories are links or files, or
        its format is not this gdskv's."""
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
        return store_attr(self.fs) or {}

    def namespace(self, spec: NamespaceSpec) -> Namespace:
        """The namespace for ``spec``, created (group + one array per layer group) if new.
        ``OSError`` saying so when it cannot be created (full disk, read-only store, links in the
        way): connectors then serve nothing, the CLI prints one line."""
        ns_id = spec.namespace_id
        with self._lock:
            if ns_id in self._namespaces:
                return self._namespaces[ns_id]
            ns = Namespace(self, spec)
            if not is_file(ns.path / "zarr.json") or any(not is_file(ns.array_path(g.layer_group_id) / "zarr.json") for g in spec.groups):
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
            for rel, doc in namespace_metadata(ns).items():
                self._write_metadata(rel, doc)

    def _write_metadata(self, rel_dir: str, doc: bytes) -> None:
        """Write a Zarr ``zarr.json`` document into ``rel_dir`` (made if missing) through
        ``fs``: never through a link, always with the store's file mode."""
        path = f"{rel_dir}/zarr.json" if rel_dir else "zarr.json"
        self.fs.write_atomic(path, doc, f"{fmt.TMP_MARK}{os.getpid()}.{time.time_ns():x}")

    def quarantine(self, ns_id: str, group: int, path: str, reason: str, announce: bool = True) -> Optional[str]:
        """Move the entry at ``path`` (a chunk, or whatever sits where a chunk belongs: a link
        moves as a link) to ``.gdskv/quarantine/<ns_id>/g<group>/``; the destination, or None
        when it is gone or cannot be moved (logged unless ``announce`` is False: ``gdskv verify
        --repair`` reports each chunk itself). Never raises, never deletes."""
        name = os.path.basename(path)
        dest = f"{PRIVATE_DIR}/quarantine/{ns_id}/g{int(group)}/{name}.{reason}.{time.time_ns()}"
        try:
            self.fs.makedirs(os.path.dirname(dest))
            self.fs.rename(path, dest)
        except FileNotFoundError:
            return None
        except OSError as e:
            if announce:
                log.warning("gdskv: %s failed verification (%s) and could not be quarantined: %s", path, reason, e)
            return None
        if announce:
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



def _being_made(root: Path) -> bool:
    """Whether the directory ``root`` is empty, or holds only what another process making a store
    there leaves before its ``zarr.json`` lands (``.gdskv/`` with the lock it holds, the document's
    temp file): ``open`` then waits on that lock and takes the store it made. Processes brought up
    together on a fresh path (a deployment's ranks) found each other's ``.gdskv/`` and refused."""
    for e in root.iterdir():
        if not (e.name == PRIVATE_DIR and e.is_dir() and not e.is_symlink()) and not e.name.startswith(f"zarr.json{fmt.TMP_MARK}"):
            return False
    return True

def _exists(path: Path) -> bool:
    """Whether ``path`` exists (a link counts); ``StoreUnreadable`` when that cannot be told (no
    permission to search the store's root)."""
    try:
        os.lstat(path)
        return True
    except PermissionError as e:
        raise StoreUnreadable(f"{path.parent} could not be read: {e.strerror}") from None
    except OSError:
        return False


def _why_not_a_store(root: Path) -> NoReturn:
    """Raise why the ``zarr.json`` at ``root`` does not make a gdskv store: this process may not
    read it (``StoreUnreadable``); it is not a regular file, does not parse, or parses without
    gdskv's attribute (``StoreError``)."""
    try:
        fs = ConfinedDir(root)
    except PermissionError as e:
        raise StoreUnreadable(f"{root} could not be read: {e.strerror}") from None
    try:
        jsondoc.loads(fs.read_small("zarr.json"))
    except PermissionError as e:
        raise StoreUnreadable(f"{root / 'zarr.json'} could not be read: {e.strerror}") from None
    except OSError as e:
        raise StoreError(f"{root / 'zarr.json'} could not be read: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreError(f"{root / 'zarr.json'} does not parse ({e}); a damaged store?") from None
    finally:
        fs.close()
    raise StoreError(f"{root} is a Zarr hierarchy but not a gdskv store (no '{STORE_ATTR}' attribute)")
