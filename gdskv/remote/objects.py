"""Chunks as remote objects: their keys, their verification, and their publication into the local store.

The remote holds the local store's Zarr layout under the configured prefix: a chunk's object key
is its file's path relative to the store root (``ns/<ns_id>/g<gid>/c/<hi>/0/<lo>``), and the
``zarr.json`` documents of the root group, each namespace group and each layer-group array are
uploaded beside them, so stock zarr opens the bucket as it opens the local store.

A remote object is trusted exactly as far as a local chunk: ``verify`` runs the load's checks
(``gdskv.checksum.check_host``: trailer, group, store key, block key, size, payload checksum, MAC
where a chunk key is configured) before a byte of it is published locally. ``publish`` writes
it beside its chunk's name and renames it into place inside the store (``store.fs``), within the
byte budget, so a reader sees a whole chunk or none.

Called by ``gdskv.remote.tier`` (read-through, uploads) and ``gdskv.remote.copy`` (push, pull).
"""
from __future__ import annotations

import errno
import itertools
import os
from typing import Any, Callable, Optional

from gdskv import checksum
from gdskv import format as fmt
from gdskv.confined import dir_path, open_data_file
from gdskv.store import Namespace, PageStore

_seq = itertools.count()


def chunk_key(ns: Namespace, group: int, key: bytes) -> str:
    """The object key of ``key``'s chunk: its path relative to the store root."""
    rel_dir, name = ns.chunk_location(group, key)
    return f"{rel_dir}/{name}"


def metadata_keys(ns: Namespace) -> list[str]:
    """The ``zarr.json`` documents a namespace needs remotely: the root's, its group's, its arrays'."""
    return ["zarr.json", f"ns/{ns.id}/zarr.json"] + [f"ns/{ns.id}/g{g.layer_group_id}/zarr.json" for g in ns.spec.groups]


METADATA_MAX_BYTES = 1 << 20
"""The largest namespace document (``zarr.json``) fetched: they are a few KiB."""


def verify(ns: Namespace, group: int, key: bytes, data: Any, auth_key: Optional[bytes]) -> Optional[str]:
    """None when ``data`` (any buffer) is exactly ``key``'s chunk in layer group ``group`` of
    ``ns``; else why not."""
    nbytes = ns.spec.group(group).bytes_per_page
    view = memoryview(data).cast("B")
    if view.nbytes != nbytes + fmt.TRAILER_BYTES:
        return "bad-size"
    return checksum.check_host(view[nbytes:], view[:nbytes], group=group, store_key=ns.store_key(group, key),
                               block_key=key, nbytes=nbytes, auth_key=auth_key)


def parent_of(data: Any) -> Optional[bytes]:
    """The parent block key a verified chunk's trailer records."""
    return fmt.unpack(memoryview(data).cast("B")[-fmt.TRAILER_BYTES:]).parent_key


def publish(ns: Namespace, group: int, key: bytes, data: Any, coming: Optional[Callable[[bytes], bool]] = None) -> bool:
    """Write a verified chunk into the local store atomically (temp file, then rename, inside its
    confined directory). False when the byte budget refuses it; ``OSError`` when the store
    cannot take it (the caller counts a miss). ``coming(parent)``: whether the chunk's parent is
    among what the caller is fetching now (replies are published as they arrive, in any order),
    so that on a full store the budget evicts for the chunk, keeping the parent, instead of
    refusing it as an orphan (``Budget.admit``'s ``saving``)."""
    store = ns.store
    data = memoryview(data).cast("B")
    nbytes = data.nbytes
    parent = parent_of(data)
    if store.budget is not None:
        on_its_way = parent is not None and coming is not None and coming(parent)
        stored, saving = (None, [parent]) if on_its_way else (parent, [])
        if not store.budget.admit(ns, group, nbytes, stored, saving):
            return False
        store.budget.on_publishing(ns, group, [(key, parent)], nbytes)
    rel_dir, name = ns.chunk_location(group, key)
    with store.fs.directory(rel_dir, create=True) as dfd:
        tmp = f"{name}{fmt.TMP_MARK}{os.getpid()}.r{next(_seq):x}"
        fd = open_data_file(dir_path(dfd, tmp), write=True, mode=store.fs.file_mode)
        try:
            try:
                view = data
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    if store.budget is not None:
        store.budget.on_published(ns, group, key, parent, nbytes)
    return True


def read_local(store: PageStore, rel: str, limit: int) -> bytes:
    """The bytes of a local chunk (never through a link, never a FIFO); ``EFBIG`` for a file of
    more than ``limit`` bytes, which is not read (a sparse terabyte where a chunk belongs must
    not take the process's memory). Called by the uploader for each chunk it uploads."""
    fd = store.fs.open_regular(rel)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"{size} bytes, more than the {limit} a chunk holds", rel)
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise OSError(f"{rel}: short read ({got} of {size} bytes)")
            got += n
        return bytes(buf)
    finally:
        os.close(fd)
