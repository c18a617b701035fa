"""``gdskv verify``: re-check every chunk's trailer, key, size and payload checksum.

The checks are the ones a load makes (``PageTransfer._verify``), plus that the chunk sits where its
store key says: the trailer parses and checks itself; its layer group is the array's; the store
key recomputed from the namespace id, the group and the trailer's block key equals the trailer's
and names this file's path; the payload is as long as the trailer says and the namespace's page;
its checksum matches (and its MAC, where the config has a chunk key: ``gdskv.checksum.check_host``).
Entries where a chunk belongs that are not regular files, chunks of damaged namespaces and chunk
directories that are links (never entered) are reported too. ``--repair`` moves bad chunks to the
quarantine (``Namespace.quarantine``); a chunk removed meanwhile (evicted by another process) is
counted as gone, not as bad. Files in a chunk directory whose names are neither a chunk index nor a
gdskv temp name (someone's notes, a backup) are not gdskv's: reported as foreign and left alone,
even with ``--repair``.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import click
from rich.table import Table

from gdskv import checksum
from gdskv import format as fmt
from gdskv.cli import _remote as remote_views
from gdskv.cli._common import auth_key_of, open_existing, print_json, select_namespaces
from gdskv.cli.output import console
from gdskv.cli.progress import Work, status_every
from gdskv.confined import NotRegularFileError, OutsideStoreError
from gdskv.store import ArrayDir, ChunkEntry, Namespace


def check_chunk(ns: Namespace, group: int, path: str, auth_key: Optional[bytes] = None) -> Optional[str]:
    """None when the chunk file at ``path`` is sound; otherwise why not (a quarantine reason),
    or ``"gone"`` when it no longer exists. Opened through ``store.fs``: a link or a FIFO at the
    path is reported, never followed or waited on."""
    try:
        fd = ns.store.fs.open_regular(path)
    except FileNotFoundError:
        return "gone"
    except NotRegularFileError:
        return "not-a-file"
    except OutsideStoreError:
        return "link"
    except OSError:
        return "unreadable"
    try:
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > ns.chunk_nbytes(group):
                return "bad-size"  # not read: a sparse terabyte must not take the memory of the run
            buf = bytearray(size)  # writable, so the CRC32C below reads it in place
            if size < fmt.TRAILER_BYTES or f.readinto(buf) < size:  # a buffered readinto fills or hits EOF
                return "truncated"
    except OSError:
        return "unreadable"
    view = memoryview(buf)
    trailer = bytes(view[size - fmt.TRAILER_BYTES:])
    try:  # the block key the chunk claims, so the check can tell a chunk in the wrong place
        claimed = fmt.unpack(trailer).block_key
    except fmt.ChunkFormatError:
        return "bad-trailer"
    if ns.chunk_path(group, claimed) != path:
        return "foreign-key"
    return checksum.check_host(trailer, view[: size - fmt.TRAILER_BYTES], group=group,
                               store_key=ns.store_key(group, claimed), block_key=claimed,
                               nbytes=ns.spec.group(group).bytes_per_page, auth_key=auth_key)


def check_entry(array: ArrayDir, entry: ChunkEntry, auth_key: Optional[bytes] = None) -> Optional[str]:
    """``check_chunk`` for one entry of the store walk; entries where a chunk belongs that are
    not chunk files, and chunks of a damaged namespace, are bad without being opened."""
    if entry.kind == "link":
        return "link"
    if entry.kind != "file":
        return "not-a-file"
    if array.namespace is None:
        return "damaged-namespace"
    return check_chunk(array.namespace, array.group, entry.path, auth_key)


@click.command()
@click.option("--repair", is_flag=True, help="Move bad chunks to the quarantine.")
@click.option("--namespace", "namespace", default=None, help="Namespace id (or a prefix of it) or model name.")
@click.option("--threads", type=click.IntRange(1, 64), default=4, show_default=True, help="Chunks checked in parallel.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts and bad chunks as JSON.")
@click.option("--remote", is_flag=True, help="Check the objects in the bucket of [gdskv.remote] (read-only: --repair does not apply).")
@click.pass_context
def verify(ctx: click.Context, repair: bool, namespace: Optional[str], threads: int, as_json: bool, remote: bool) -> None:
    """Re-check every chunk's checksum and key; exit 1 when any is bad."""
    if remote:
        if repair:
            raise click.UsageError("--repair works on the local store only; a bad remote object is a miss for every reader")
        return remote_views.verify(ctx, namespace, as_json)
    cfg, store = open_existing(ctx)
    auth_key = auth_key_of(cfg)
    chosen = None if namespace is None else select_namespaces(store, namespace)
    arrays = store.arrays([store.namespace(ns.spec) for ns in chosen] if chosen is not None else None)
    arrays = [a if a.namespace is None else replace(a, namespace=store.namespace(a.namespace.spec)) for a in arrays]
    entries = [(a, e) for a in arrays for e in store.chunk_entries(a)]
    files = [(a, e) for a, e in entries if e.lo is not None]
    foreign = [{"namespace": a.ns_id, "group": a.group, "path": e.path} for a, e in entries
               if e.lo is None and not fmt.is_temp_name(e.name)]
    foreign += [{"namespace": a.ns_id, "group": a.group, "path": path} for a in arrays for path in store.skipped_entries(a)]
    if chosen is None:
        foreign += [{"namespace": None, "group": None, "path": path} for path in store.linked_trees()]
    counts: Counter[str] = Counter()
    bad: list[dict[str, object]] = []
    with Work("verify", len(files), "chunks", status_every(ctx), bar=not as_json) as work, ThreadPoolExecutor(threads) as pool:
        checks = pool.map(lambda f: check_entry(*f, auth_key), files)
        for (array, entry), reason in zip(files, checks):
            work.advance()
            counts[reason or "ok"] += 1
            if reason is None or reason == "gone":
                continue
            item: dict[str, object] = {"namespace": array.ns_id, "group": array.group, "path": entry.path, "reason": reason}
            if repair:
                if array.namespace is not None:
                    dest = array.namespace.quarantine(array.group, entry.path, reason, announce=False)
                else:
                    dest = store.quarantine(array.ns_id, array.group, entry.path, reason, announce=False)
                item["quarantined_to"] = dest
                if dest is None and os.path.lexists(entry.path):
                    counts["repair_failed"] += 1
            bad.append(item)
    if repair and bad:
        store.flush_stats()
    rep = {"checked": len(files), "ok": counts["ok"], "bad": len(bad), "gone": counts["gone"],
           "reasons": {k: v for k, v in counts.items() if k not in ("ok", "gone", "repair_failed")}, "repaired": repair,
           "repair_failed": counts["repair_failed"], "bad_chunks": bad, "foreign": foreign}
    if as_json:
        print_json(rep)
    else:
        out = console()
        if bad:
            done = f" ({rep['repair_failed']} could not be quarantined)" if rep["repair_failed"] else " (quarantined)"
            t = Table(title="bad chunks" + (done if repair else " (run with --repair to quarantine)"))
            for col in ("namespace", "group", "reason", "path"):
                t.add_column(col)
            for b in bad:
                t.add_row(str(b["namespace"]), str(b["group"]), str(b["reason"]), str(b["path"]))
            out.print(t)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(rep["reasons"].items()))
        out.print(f"checked {rep['checked']} chunks: {rep['ok']} ok, {rep['bad']} bad" + (f" ({reasons})" if reasons else "")
                  + (f", {rep['gone']} removed meanwhile" if rep["gone"] else "")
                  + (f"; {rep['repair_failed']} could not be quarantined (read-only or full store?)" if rep["repair_failed"] else "")
                  + (f"; {len(foreign)} foreign file{'s' * (len(foreign) != 1)} left alone (not gdskv's: "
                     f"{', '.join(str(f['path']) for f in foreign[:3])}{', ...' if len(foreign) > 3 else ''})" if foreign else ""))
    if bad:
        ctx.exit(1)
