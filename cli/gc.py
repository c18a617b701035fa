"""``gdskv gc``: remove what crashed processes left behind, safely while others use the store.

Removes exactly two kinds of things:

- temporary files (``<name>.tmp.<pid>[.<rand>]``: unfinished chunk writes beside their chunk,
  unfinished stats and index files under ``.gdskv/``) whose writer is gone: the pid is not alive on
  this host and the file has not changed for ``--min-age``, or — whatever the pid (another host on
  a shared file system, a reused pid) — the file has not changed for ``--grace``;
- empty chunk directories under an array's ``c/`` not changed for ``--min-age`` (a writer creates
  its directory just before it writes; ``rmdir`` never removes a directory that has a file).

Nothing else is touched: no published chunk, no metadata, no quarantine.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import click
from rich.console import Console

from gdskv import format as fmt
from gdskv.cli._common import human_bytes, open_existing, parse_duration, print_json
from gdskv.store import PageStore


def writer_pid(name: str) -> Optional[int]:
    """The pid a temp file name carries (``...tmp.<pid>`` or ``...tmp.<pid>.<rand>``), if any."""
    tail = name.rsplit(fmt.TMP_MARK, 1)[-1]
    head = tail.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def temp_file_is_stale(name: str, age_s: float, min_age_s: float, grace_s: float) -> bool:
    """The removal rule for one temp file (pure apart from the pid probe)."""
    if age_s >= grace_s:
        return True
    pid = writer_pid(name)
    return age_s >= min_age_s and pid is not None and pid != os.getpid() and not pid_alive(pid)


@dataclass
class Garbage:
    temp_files: list[tuple[str, int]] = field(default_factory=list)  # (path, bytes)
    empty_dirs: list[str] = field(default_factory=list)


def _temp_candidates(store: PageStore) -> Iterator[os.DirEntry]:
    """Every temp-named file in the arrays' chunk directories and under ``.gdskv/``."""
    dirs: list[str] = []
    for ns in store.namespaces():
        for g in ns.spec.groups:
            cdir = ns.array_path(g.layer_group_id) / "c"
            if cdir.is_dir():
                dirs += [f"{hi.path}/0" for hi in os.scandir(cdir) if hi.is_dir(follow_symlinks=False)]
    if store.private.is_dir():
        dirs += [str(p) for p in store.private.rglob("*") if p.is_dir() and not p.is_symlink()] + [str(store.private)]
    for d in dirs:
        try:
            entries = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if fmt.is_temp_name(e.name) and e.is_file(follow_symlinks=False):
                yield e


def find_garbage(store: PageStore, min_age_s: float, grace_s: float, now: Optional[float] = None) -> Garbage:
    """What ``gc`` would remove now."""
    now = time.time() if now is None else now
    out = Garbage()
    for e in _temp_candidates(store):
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if temp_file_is_stale(e.name, now - st.st_mtime, min_age_s, grace_s):
            out.temp_files.append((e.path, st.st_size))
    for ns in store.namespaces():
        for g in ns.spec.groups:
            cdir = ns.array_path(g.layer_group_id) / "c"
            for hi in os.scandir(cdir) if cdir.is_dir() else ():
                sub = f"{hi.path}/0"
                try:
                    if not os.listdir(sub) and now - os.stat(sub).st_mtime >= min_age_s:
                        out.empty_dirs.append(sub)
                    left = [n for n in os.listdir(hi.path) if not (n == "0" and out.empty_dirs[-1:] == [sub])]
                    if not left and now - os.stat(hi.path).st_mtime >= min_age_s:
                        out.empty_dirs.append(hi.path)
                except (FileNotFoundError, NotADirectoryError):
                    continue
    return out


@click.command()
@click.option("--grace", default="1h", show_default=True, help="Temp files older than this go whatever their pid.")
@click.option("--min-age", "min_age", default="60s", show_default=True, help="Nothing younger than this goes.")
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def gc(ctx: click.Context, grace: str, min_age: str, dry_run: bool, as_json: bool) -> None:
    """Remove temp files left by crashed writers and empty chunk directories."""
    _, store = open_existing(ctx)
    garbage = find_garbage(store, parse_duration(min_age), parse_duration(grace))
    removed_files = removed_dirs = freed = 0
    if not dry_run:
        for path, size in garbage.temp_files:
            try:
                os.unlink(path)
                removed_files += 1
                freed += size
            except FileNotFoundError:  # its writer finished (renamed it) or someone else collected it
                pass
        for d in garbage.empty_dirs:  # ``<hi>/0`` comes before ``<hi>``
            try:
                os.rmdir(d)
                removed_dirs += 1
            except OSError:  # a writer put a file there meanwhile: keep it
                pass
    rep = {"dry_run": dry_run, "temp_files": [p for p, _ in garbage.temp_files], "empty_dirs": garbage.empty_dirs,
           "removed_temp_files": removed_files, "removed_dirs": removed_dirs, "freed_bytes": freed}
    if as_json:
        print_json(rep)
        return
    console = Console()
    if dry_run:
        for p in rep["temp_files"] + rep["empty_dirs"]:
            console.print(f"would remove {p}")
        console.print(f"would remove {len(garbage.temp_files)} temp files and {len(garbage.empty_dirs)} empty directories")
    else:
        console.print(f"removed {removed_files} temp files ({human_bytes(freed)}) and {removed_dirs} empty directories")
