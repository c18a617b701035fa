"""The one walk of a store's tree (``PageStore``'s ``namespaces``, ``arrays``,
``chunk_entries``): eviction, garbage collection, verification and listings start here. Every
directory is read through ``PageStore.fs`` and a link is never entered."""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from gdskv import jsondoc
from gdskv.store.namespace import Namespace
from gdskv.store.spec import NamespaceSpec
from gdskv.store.tree import GROUP_DIR, NAMESPACE_ATTR, NAMESPACE_ID


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


class Walking:
    """The walking methods of ``PageStore`` (``gdskv.store.core``), which holds their state."""

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
                doc = jsondoc.loads(self.fs.read_small(f"ns/{e.name}/zarr.json"))
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

    def skipped_entries(self, array: ArrayDir) -> Iterator[str]:
        """The paths in ``array``'s chunk hierarchy that ``chunk_entries`` skips without entering:
        links (a chunk directory linked elsewhere) and entries not named as Zarr names them.
        Called by ``gdskv verify``, which reports them as not gdskv's."""
        base = f"ns/{array.ns_id}/g{array.group}/c"
        for hi in self.fs.scandir(base):
            if hi.kind != "dir" or not hi.name.isdigit():
                yield f"{self.root}/{base}/{hi.name}"
                continue
            for e in self.fs.scandir(f"{base}/{hi.name}"):
                if e.kind != "dir" or e.name != "0":
                    yield f"{self.root}/{base}/{hi.name}/{e.name}"

    def linked_trees(self) -> Iterator[str]:
        """The namespace and layer-group directories that are links (``ns/<id>``,
        ``ns/<id>/g<gid>``): ``arrays`` never enters them, so their chunks are not the store's.
        Called by ``gdskv verify``, which reports them as not gdskv's."""
        for e in sorted(self.fs.scandir("ns"), key=lambda e: e.name):
            if e.kind == "link":
                yield f"{self.root}/ns/{e.name}"
            elif e.kind == "dir" and NAMESPACE_ID.match(e.name):
                for g in sorted(self.fs.scandir(f"ns/{e.name}"), key=lambda g: g.name):
                    if g.kind == "link":
                        yield f"{self.root}/ns/{e.name}/{g.name}"

    def iter_chunk_files(self, namespaces: Optional[Sequence[Namespace]] = None) -> Iterator[tuple[Namespace, int, ChunkEntry]]:
        """Every published chunk file of sound ``namespaces`` (default all): ``(namespace,
        group, entry)``. Called by tests and tools that read chunks."""
        for array in self.arrays(namespaces if namespaces is not None else self.namespaces()):
            for e in self.chunk_entries(array):
                if e.is_chunk and array.namespace is not None:
                    yield array.namespace, array.group, e

