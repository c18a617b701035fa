"""``gdskv verify``: re-check every chunk's trailer, key, size and payload checksum.

The checks are the ones a load makes (``PageTransfer._verify``), plus that the chunk sits where its
store key says: the trailer parses and checks itself; its layer group is the array's; the store
key recomputed from the namespace id, the group and the trailer's block key equals the trailer's
and names this file's path; the payload is as long as the trailer says and the namespace's page;
its CRC32C matches. ``--repair`` moves bad chunks to the quarantine (``Namespace.quarantine``);
a chunk removed meanwhile (evicted by another process) is counted as gone, not as bad.
"""
from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from gdskv import format as fmt
from gdskv.cli._common import open_existing, print_json, select_namespaces
from gdskv.store import Namespace


def check_chunk(ns: Namespace, group: int, path: str) -> Optional[str]:
    """None when the chunk file at ``path`` is sound; otherwise why not (a quarantine reason),
    or ``"gone"`` when it no longer exists."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)  # writable, so the CRC32C below reads it in place
            if size < fmt.TRAILER_BYTES or f.readinto(buf) < size:  # a buffered readinto fills or hits EOF
                return "truncated"
    except FileNotFoundError:
        return "gone"
    view = memoryview(buf)
    payload = view[: size - fmt.TRAILER_BYTES]
    try:
        t = fmt.unpack(bytes(view[size - fmt.TRAILER_BYTES:]))
    except fmt.ChunkFormatError:
        return "bad-trailer"
    # ``unpack`` checked the block key's length, so the store key can be computed
    if t.layer_group != group or t.store_key != ns.store_key(group, t.block_key) or ns.chunk_path(group, t.block_key) != path:
        return "foreign-key"
    if t.payload_nbytes != payload.nbytes or t.payload_nbytes != ns.spec.group(group).bytes_per_page:
        return "bad-size"
    if fmt.payload_checksum(t.checksum_algo, payload) != t.payload_crc:
        return "bad-checksum"
    return None


@click.command()
@click.option("--repair", is_flag=True, help="Move bad chunks to the quarantine.")
@click.option("--namespace", "namespace", default=None, help="Namespace id (or a prefix of it) or model name.")
@click.option("--threads", type=click.IntRange(1, 64), default=4, show_default=True, help="Chunks checked in parallel.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts and bad chunks as JSON.")
@click.pass_context
def verify(ctx: click.Context, repair: bool, namespace: Optional[str], threads: int, as_json: bool) -> None:
    """Re-check every chunk's checksum and key; exit 1 when any is bad."""
    _, store = open_existing(ctx)
    namespaces = {ns.id: store.namespace(ns.spec) for ns in select_namespaces(store, namespace)}
    files = [(ns, g, e.path) for ns, g, e in store.iter_chunk_files(list(namespaces.values()))]
    counts: Counter[str] = Counter()
    bad: list[dict[str, object]] = []
    console = Console(stderr=True)
    with Progress(TextColumn("verify"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console,
                  disable=as_json or not console.is_terminal) as progress, ThreadPoolExecutor(threads) as pool:
        task = progress.add_task("chunks", total=len(files))
        checks = pool.map(lambda f: check_chunk(namespaces[f[0].id], f[1], f[2]), files)
        for (ns, group, path), reason in zip(files, checks):
            progress.advance(task)
            counts[reason or "ok"] += 1
            if reason is None or reason == "gone":
                continue
            entry: dict[str, object] = {"namespace": ns.id, "group": group, "path": path, "reason": reason}
            if repair:
                entry["quarantined_to"] = namespaces[ns.id].quarantine(group, path, reason)
            bad.append(entry)
    if repair and bad:
        store.flush_stats()
    rep = {"checked": len(files), "ok": counts["ok"], "bad": len(bad), "gone": counts["gone"],
           "reasons": {k: v for k, v in counts.items() if k not in ("ok", "gone")}, "repaired": repair, "bad_chunks": bad}
    if as_json:
        print_json(rep)
    else:
        out = Console()
        if bad:
            t = Table(title="bad chunks" + (" (quarantined)" if repair else " (run with --repair to quarantine)"))
            for col in ("namespace", "group", "reason", "path"):
                t.add_column(col)
            for b in bad:
                t.add_row(str(b["namespace"]), str(b["group"]), str(b["reason"]), str(b["path"]))
            out.print(t)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(rep["reasons"].items()))
        out.print(f"checked {rep['checked']} chunks: {rep['ok']} ok, {rep['bad']} bad" + (f" ({reasons})" if reasons else "")
                  + (f", {rep['gone']} removed meanwhile" if rep["gone"] else ""))
    if bad:
        ctx.exit(1)
