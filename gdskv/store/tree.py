"""The names in a store's tree and its Zarr metadata documents (written by ``PageStore`` through
its confined directory, never by zarr itself)."""
from __future__ import annotations

import os
import re
import stat
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import zarr
from zarr.storage import MemoryStore

from gdskv import format as fmt
from gdskv import jsondoc
from gdskv.confined import ConfinedDir

if TYPE_CHECKING:
    from gdskv.store.namespace import Namespace

STORE_ATTR = "gdskv"
NAMESPACE_ATTR = "gdskv_namespace"
PRIVATE_DIR = ".gdskv"
NAMESPACE_ID = re.compile(r"^[0-9a-f]{16}$")
GROUP_DIR = re.compile(r"^g(0|[1-9][0-9]{0,9})$")


def _metadata_documents(build) -> dict[str, bytes]:
    """Zarr's own ``zarr.json`` documents for a hierarchy ``build`` makes in memory (written to
    disk by ``PageStore._write_metadata``, so that zarr never writes through a link)."""
    mem = MemoryStore()
    build(zarr.open_group(store=mem, mode="w", zarr_format=3))
    return {key.rpartition("/")[0]: buf.to_bytes() for key, buf in mem._store_dict.items() if key.endswith("zarr.json")}


def root_metadata() -> bytes:
    return _metadata_documents(lambda g: g.attrs.update({STORE_ATTR: {"format_version": fmt.FORMAT_VERSION}}))[""]


def namespace_metadata(ns: Namespace) -> dict[str, bytes]:
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


def is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def store_attr(fs: ConfinedDir) -> Optional[dict[str, Any]]:
    """The root ``zarr.json``'s ``gdskv`` attribute when it is a regular file that parses into
    an object, else None."""
    try:
        doc = jsondoc.loads(fs.read_small("zarr.json"))
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
        return store_attr(fs) is not None
    finally:
        fs.close()
