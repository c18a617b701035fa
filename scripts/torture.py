#!/usr/bin/env python
"""Adversarial torture harness for gdskv: real stores on real files, real processes, real SIGKILL.

Each scenario runs many trials and counts what the store promises never happens:

- wrong loads: a LOADED page whose bytes differ from the bytes saved under that key;
- exceptions to the caller: an exception out of a save/load future or out of a library call a
  server makes (bring-up, lookups, touch), or a traceback from the ``gdskv`` command line;
- lost published or leased chunks: a chunk whose save resolved PUBLISHED (or that a lookup leased)
  and that is gone or unreadable while it should be there;
- files touched outside the store: any change (existence, content, size, mtime, atime, new entry)
  in a canary directory made beside each store;
- hangs: an operation that does not finish within its deadline (the harness never waits forever:
  risky operations run in forked children or threads with deadlines, and stuck children are killed);
- other violations: everything else a scenario checks (a corrupt chunk left in place instead of
  quarantined, a half-made store tree, temp files left behind, a free-space floor crossed, a CLI
  error that is not one line, ...). Each is listed under the table.

Usage::

    python scripts/torture.py                 # full counts (minutes)
    python scripts/torture.py --fast          # the CI variant (about a minute on 2 cores)
    python scripts/torture.py --only crash --json
    python scripts/torture.py --only concurrency --seconds 300 --dir /mnt/nvme/tmp

Exit status 0 only when every count column of every row is 0. Scenarios that need to mount file
systems (full disk, read-only store) are skipped, with the reason, where mounting is not allowed.
Command-line calls run gdskv's click entry point in a forked child (``--real-cli`` runs a fresh
``python -m gdskv.cli.main`` instead); the crash scenario's ``gdskv gc`` is always a fresh process.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from gdskv import format as fmt
from gdskv.bench import sigterm_as_exit
from gdskv.config import ConfigError, GdsKvConfig, load_config
from gdskv.eviction import install_budget
from gdskv.garbage import collect_in_background
from gdskv.io import make_engine
from gdskv.store import GroupSpec, NamespaceSpec, PageStore, StoreError
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

COUNTS = ("wrong_loads", "exceptions", "lost", "outside", "hangs", "other")
KIND_TO_FIELD = {"wrong": "wrong_loads", "exc": "exceptions", "lost": "lost", "outside": "outside",
                 "hang": "hangs", "other": "other"}
MAX_DETAILS = 40
AGED_NS = 2 * 86400 * 10**9  # canary entries look two days old: older than gc's grace
DEAD_PID = 999_999_999  # above any pid_max: never alive


# --- results -----------------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    checksum: str = "-"
    trials: int = 0
    wrong_loads: int = 0
    exceptions: int = 0
    lost: int = 0
    outside: int = 0
    hangs: int = 0
    other: int = 0
    seconds: float = 0.0
    skipped: Optional[str] = None
    details: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _seen: dict[str, int] = field(default_factory=dict, repr=False)

    def add(self, kind: str, msg: str, n: int = 1) -> None:
        f = KIND_TO_FIELD[kind]
        setattr(self, f, getattr(self, f) + n)
        key = f"{f}: {msg}"[:400]
        self._seen[key] = self._seen.get(key, 0) + n
        if key not in self.details and len(self.details) < MAX_DETAILS:
            self.details.append(key)

    def apply(self, events: list[tuple[str, str]]) -> list[str]:
        """Count a child's events; return its ``data`` payloads."""
        data = []
        for kind, msg in events:
            if kind == "trial":
                self.trials += 1
            elif kind == "data":
                data.append(msg)
            elif kind in KIND_TO_FIELD:
                self.add(kind, msg)
        return data

    @property
    def failed(self) -> bool:
        return any(getattr(self, f) for f in COUNTS)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_seen")
        d["detail_counts"] = dict(sorted(self._seen.items(), key=lambda kv: -kv[1])[:40])
        return d


@dataclass
class Settings:
    fast: bool
    seconds: float
    real_cli: bool
    base: Path
    corruption_trials: int
    crash_trials: int
    removal_trials: int
    cli_timeout: float
    op_timeout: float
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)

    @classmethod
    def make(cls, fast: bool, base: Path, seconds: Optional[float] = None, real_cli: bool = False) -> "Settings":
        if fast:
            return cls(True, seconds if seconds is not None else 8.0, real_cli, base, corruption_trials=200, crash_trials=10,
                       removal_trials=3, cli_timeout=6.0, op_timeout=3.0)
        return cls(False, seconds if seconds is not None else 120.0, real_cli, base, corruption_trials=3000, crash_trials=300,
                   removal_trials=20, cli_timeout=40.0, op_timeout=20.0)


# --- canary ------------------------------------------------------------------------------------
def _read_noatime(path: str, dir_fd: Optional[int] = None) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


class Canary:
    """A directory beside a store, with entries that look like store contents (chunk-like names,
    temp names with a dead pid, aged times, empty directories). ``check`` reports every change."""

    def __init__(self, path: Path, chunk_size: int = 4096 + fmt.TRAILER_BYTES):
        self.path = path
        self.chunk_size = chunk_size
        self.baseline: dict[str, tuple] = {}

    def create(self) -> "Canary":
        p = self.path
        files = {
            "1": self.chunk_size, "x.tmp.123": 100, f"9.tmp.{DEAD_PID}.a": 300,
            "0/0": self.chunk_size, "0/1": 77, f"0/2.tmp.{DEAD_PID}.b": self.chunk_size,
            "7/0/0": self.chunk_size, "7/0/3": self.chunk_size, f"7/0/4.tmp.{DEAD_PID}.c": 64,
            "c/7/0/5": self.chunk_size, f"c/7/0/6.tmp.{DEAD_PID}.d": 10,
            ".gdskv/lock": 0, f".gdskv/stats/h-1-1.json.tmp.{DEAD_PID}": 20,
        }
        dirs = ["empty", "8/0", "c/8/0", ".gdskv/quarantine"]
        for i, (rel, size) in enumerate(sorted(files.items())):
            f = p / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(hashlib.sha256(f"canary/{rel}".encode()).digest() * (size // 32) + b"c" * (size % 32))
        for d in dirs:
            (p / d).mkdir(parents=True, exist_ok=True)
        aged = time.time_ns() - AGED_NS
        for root, dnames, fnames in sorted(os.walk(p, topdown=False), key=lambda t: -t[0].count(os.sep)):
            for n in fnames:
                os.utime(os.path.join(root, n), ns=(aged, aged), follow_symlinks=False)
            os.utime(root, ns=(aged, aged))
        return self

    def snapshot(self) -> dict[str, tuple]:
        out: dict[str, tuple] = {}
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOATIME", 0)

        def walk(rel: str) -> None:
            full = os.path.join(self.path, rel) if rel else str(self.path)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                return
            if stat.S_ISDIR(st.st_mode):
                try:
                    fd = os.open(full, flags)
                except PermissionError:
                    fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    names = sorted(e.name for e in os.scandir(fd))
                finally:
                    os.close(fd)
                out[rel or "."] = ("dir", 0, "", st.st_mtime_ns, st.st_atime_ns, st.st_mode)
                for n in names:
                    walk(os.path.join(rel, n))
            elif stat.S_ISREG(st.st_mode):
                h = hashlib.sha256(_read_noatime(full)).hexdigest()
                out[rel] = ("file", st.st_size, h, st.st_mtime_ns, st.st_atime_ns, st.st_mode)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, os.readlink(full), st.st_mtime_ns, st.st_atime_ns, st.st_mode)
            else:
                out[rel] = ("special", 0, "", st.st_mtime_ns, st.st_atime_ns, st.st_mode)

        walk("")
        return out

    def arm(self) -> "Canary":
        self.baseline = self.snapshot()
        return self

    def check(self, row: Row, where: str) -> int:
        now = self.snapshot()
        diffs = 0
        names = ("kind", "size", "content", "mtime", "atime", "mode")
        what: list[str] = []
        for rel in sorted(set(self.baseline) | set(now)):
            a, b = self.baseline.get(rel), now.get(rel)
            if a is None:
                what.append(f"{rel} new")
            elif b is None:
                what.append(f"{rel} removed")
            elif a != b:
                what.append(f"{rel} " + "+".join(n for n, x, y in zip(names, a, b) if x != y))
        diffs = len(what)
        if diffs:
            row.add("outside", f"{where}: {diffs} canary entries changed: " + ", ".join(what), n=diffs)
        self.baseline = now  # report each change once
        return diffs


# --- pages, keys, stores -----------------------------------------------------------------------
def key_of(*parts: Any) -> bytes:
    return hashlib.sha256("torture/".encode() + "/".join(map(str, parts)).encode()).digest()


def page_bytes(seed: int, n: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed & (2**63 - 1)).integers(0, 256, n, dtype=np.uint8))


def seed_of(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def split(page: torch.Tensor, regions: list[int]) -> list[torch.Tensor]:
    out, off = [], 0
    for n in regions:
        out.append(page[off:off + n])
        off += n
    return out


def make_spec(regions: list[int], model: str = "torture", groups: int = 1) -> NamespaceSpec:
    n = sum(regions)
    return NamespaceSpec(model, "uint8", 16, tuple(GroupSpec(g, n, (g,), None) for g in range(groups)))


def checksum_kwarg() -> Optional[str]:
    params = inspect.signature(PageTransfer.__init__).parameters
    for name in ("checksum", "checksum_algo", "algorithm"):
        if name in params:
            return name
    return None


def transfer_for(ns: Any, checksum: Optional[int] = None, threads: int = 4, cfg: Optional[GdsKvConfig] = None) -> tuple[PageTransfer, Any]:
    engine = make_engine(cfg or GdsKvConfig(store_path=str(ns.store.root)))
    kw: dict[str, Any] = {}
    if checksum is not None:
        name = checksum_kwarg()
        if name is None:
            raise RuntimeError("PageTransfer has no checksum option to force an algorithm")
        kw[name] = checksum
    return PageTransfer(ns, engine, threads=threads, **kw), engine


def checksum_algorithms() -> list[tuple[str, Optional[int]]]:
    """``("crc32c", None)`` (the default for CPU pages) and every other payload checksum
    algorithm the library defines (device checksums), forced on CPU pages."""
    found: dict[int, list[str]] = {}
    mods = [fmt]
    try:
        import gdskv.checksum as ck  # type: ignore

        mods.append(ck)
    except ImportError:
        pass
    for mod in mods:
        for name in dir(mod):
            v = getattr(mod, name)
            if name.startswith("CHECKSUM_") and isinstance(v, int) and not isinstance(v, bool):
                found.setdefault(v, [])
                label = name.removeprefix("CHECKSUM_").lower()
                if label not in found[v]:
                    found[v].append(label)
    crc = getattr(fmt, "CHECKSUM_CRC32C", 0)
    out: list[tuple[str, Optional[int]]] = [("crc32c(default)", None)]
    for v, labels in sorted(found.items()):
        if v != crc:
            out.append(("/".join(labels) + "(forced)", v))
    return out


def temp_files(root: Path) -> list[str]:
    out = []
    for dirpath, dnames, fnames in os.walk(root):
        out += [os.path.join(dirpath, n) for n in fnames + dnames if fmt.TMP_MARK in n]
    return out


def tree(root: Path) -> tuple[set[str], set[str]]:
    """(files, dirs) under ``root`` as relative paths, without following links."""
    files, dirs = set(), set()
    for dirpath, dnames, fnames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for n in dnames:
            p = os.path.normpath(os.path.join(rel, n))
            (dirs if not os.path.islink(os.path.join(dirpath, n)) else files).add(p)
        for n in fnames:
            files.add(os.path.normpath(os.path.join(rel, n)))
    return files, dirs


def quiet_library() -> None:
    logging.getLogger("gdskv").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)


# --- children with deadlines -------------------------------------------------------------------
class Rep:
    """A forked child's report channel: JSON lines appended to a file (survives SIGKILL)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def ev(self, kind: str, msg: str = "") -> None:
        os.write(self.fd, (json.dumps([kind, str(msg)[:300]]) + "\n").encode())

    def guard(self, what: str, fn: Callable, *args: Any, timeout: float = 20.0, allowed: tuple = (), **kw: Any) -> Any:
        """Run ``fn`` on a daemon thread: an exception is reported (unless ``allowed``), a call
        that outlives ``timeout`` is a hang (its thread is abandoned). Returns fn's result or None."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["r"] = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001 - everything counts
                box["e"] = e
                box["tb"] = traceback.format_exc(limit=4)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            self.ev("hang", f"{what}: not finished after {timeout:.0f}s")
            return None
        if "e" in box:
            if not isinstance(box["e"], allowed):
                self.ev("exc", f"{what}: {type(box['e']).__name__}: {box['e']}")
            return None
        return box.get("r")

    def result(self, what: str, fut: Any, timeout: float = 20.0) -> Any:
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            self.ev("hang", f"{what}: future not resolved after {timeout:.0f}s")
        except BaseException as e:  # noqa: BLE001
            self.ev("exc", f"{what}: {type(e).__name__}: {e}")
        return None


def _read_events(path: str) -> list[tuple[str, str]]:
    out = []
    try:
        for line in Path(path).read_text(errors="replace").splitlines():
            try:
                k, m = json.loads(line)
                out.append((k, m))
            except ValueError:
                pass
    except FileNotFoundError:
        pass
    return out


def spawn(fn: Callable, *args: Any) -> tuple[int, str]:
    """Fork a child running ``fn(rep, *args)``; returns (pid, events file)."""
    fd, evpath = tempfile.mkstemp(prefix="torture-ev-", suffix=".jsonl")
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            rep = Rep(evpath)
            threading.excepthook = lambda a: rep.ev("exc", f"thread {a.thread.name if a.thread else '?'}: {a.exc_type.__name__}: {a.exc_value}")
            fn(rep, *args)
        except BaseException:  # noqa: BLE001
            code = 1
            try:
                rep.ev("exc", "escaped the child: " + traceback.format_exc(limit=3)[-280:])
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(code)
    return pid, evpath


def wait_pid(pid: int, timeout: float) -> bool:
    """Wait for ``pid``; kill it (SIGKILL) after ``timeout``. True when it exited by itself."""
    deadline = time.monotonic() + timeout
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return True
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return False
        time.sleep(0.005)


def run_child(row: Row, what: str, timeout: float, fn: Callable, *args: Any) -> list[str]:
    pid, evpath = spawn(fn, *args)
    finished = wait_pid(pid, timeout)
    events = _read_events(evpath)
    os.unlink(evpath)
    if what:
        events = [(k, f"{what}: {m}" if k in KIND_TO_FIELD else m) for k, m in events]
    data = row.apply(events)
    if not finished:
        row.add("hang", f"{what}: child killed after {timeout:.0f}s")
    return data


# --- the command line ----------------------------------------------------------------------------
@dataclass
class CliResult:
    args: list[str]
    rc: Optional[int]
    out: str
    err: str
    seconds: float

    @property
    def hung(self) -> bool:
        return self.rc is None


def _cli_child(args: list[str], env: dict[str, Optional[str]], out_fd: int, err_fd: int) -> None:
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        logging.getLogger("gdskv").setLevel(logging.NOTSET)
        from gdskv.cli.main import main

        try:
            main.main(args=list(args), prog_name="gdskv", standalone_mode=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - what python would print and exit 1 with
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_cli(args: list[str], timeout: float, env: Optional[dict[str, Optional[str]]] = None, real: bool = False) -> CliResult:
    env = {"GDSKV_CONFIG": None, "GDSKV_STORE": None, **(env or {})}
    t0 = time.monotonic()
    if real:
        full = {k: v for k, v in os.environ.items() if k not in env}
        full.update({k: v for k, v in env.items() if v is not None})
        try:
            r = subprocess.run([sys.executable, "-m", "gdskv.cli.main", *args], capture_output=True, text=True,
                               errors="replace", timeout=timeout, env=full)
            return CliResult(args, r.returncode, r.stdout, r.stderr, time.monotonic() - t0)
        except subprocess.TimeoutExpired as e:
            return CliResult(args, None, str(e.stdout or ""), str(e.stderr or ""), time.monotonic() - t0)
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _cli_child(args, env, fo.fileno(), fe.fileno())
        deadline = time.monotonic() + timeout
        rc: Optional[int] = None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        fo.seek(0)
        fe.seek(0)
        return CliResult(args, rc, fo.read().decode(errors="replace"), fe.read().decode(errors="replace"), time.monotonic() - t0)


def judge_cli(row: Row, r: CliResult, where: str, expect_usage_error: bool = False) -> None:
    """A command must finish, exit 0/1/2, print no traceback, and say a usage error in one line."""
    name = " ".join(a for a in r.args if not a.startswith("/"))[:60]
    if r.hung:
        row.add("hang", f"{where}: gdskv {name} did not finish")
        return
    err_lines = [ln for ln in r.err.splitlines() if ln.strip()]
    if "Traceback (most recent call last)" in r.err:
        last = err_lines[-1] if err_lines else ""
        row.add("exc", f"{where}: gdskv {name}: traceback ({last[:120]})")
        return
    if r.rc not in (0, 1, 2):
        row.add("exc", f"{where}: gdskv {name}: exit status {r.rc}")
        return
    if r.rc == 2 and len(err_lines) != 1:
        row.add("other", f"{where}: gdskv {name}: usage error is {len(err_lines)} lines, not one")
    if expect_usage_error and r.rc != 2:
        row.add("other", f"{where}: gdskv {name}: exit {r.rc}, expected 2 (a usage error naming the problem)")


def store_args(root: Path) -> list[str]:
    return ["--store", str(root)]


# --- mounts ------------------------------------------------------------------------------------
def mount_tmpfs(path: Path, size: str) -> Optional[str]:
    """Mount a tmpfs at ``path``; returns why not, or None."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs"
    if shutil.which("mount") is None:
        return "no mount command"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode:
        return f"mount -t tmpfs refused: {(r.stderr or r.stdout).strip()[:120]}"
    return None


def remount(path: Path, mode: str) -> Optional[str]:
    r = subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], capture_output=True, text=True)
    return None if r.returncode == 0 else f"remount,{mode} refused: {(r.stderr or r.stdout).strip()[:120]}"


def umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fresh_dir(s: Settings, name: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=s.base))
    return d


# ================================================================================================
# 1. corruption
# ================================================================================================
GEOMS = [[4096], [262144], [5000], [3, 70001, 4096], [131072, 131072], [2 * 65521 + 7]]
CORRUPT_KEYS = 4


def _mutations() -> list[str]:
    return ["flip_payload", "flip_trailer", "flip_many", "pattern_121", "pattern_k", "swap_bytes", "swap_65521",
            "block_4k", "truncate", "zero_tail", "append", "swap_chunks", "copy_namespace", "copy_group", "copy_key"]


def _mutate(data: bytearray, kind: str, payload: int, rng: random.Random) -> bytearray:
    n = len(data)
    if kind == "flip_payload":
        i = rng.randrange(payload)
        data[i] ^= 1 << rng.randrange(8)
    elif kind == "flip_trailer":
        i = payload + rng.randrange(fmt.TRAILER_BYTES)
        data[i] ^= 1 << rng.randrange(8)
    elif kind == "flip_many":
        for _ in range(rng.randint(2, 8)):
            i = rng.randrange(n)
            data[i] ^= 1 << rng.randrange(8)
    elif kind in ("pattern_121", "pattern_k"):
        k = 1 if kind == "pattern_121" else rng.randint(1, 40)
        if payload >= 3:
            for _ in range(64):
                i = rng.randrange(payload - 2)
                if data[i] + k <= 255 and data[i + 1] >= 2 * k and data[i + 2] + k <= 255:
                    data[i] += k
                    data[i + 1] -= 2 * k
                    data[i + 2] += k
                    break
    elif kind in ("swap_bytes", "swap_65521"):
        gap = 65521 if kind == "swap_65521" and payload > 65521 else None
        for _ in range(64):
            i = rng.randrange(payload - (gap or 0))
            j = i + gap if gap else rng.randrange(payload)
            if data[i] != data[j]:
                data[i], data[j] = data[j], data[i]
                break
    elif kind == "block_4k":
        start = rng.randrange(0, max(1, n), 4096) if n > 4096 else 0
        end = min(n, start + 4096)
        data[start:end] = (bytes(end - start) if rng.random() < 0.5 else rng.randbytes(end - start))
    elif kind == "truncate":
        del data[rng.randrange(n):]
    elif kind == "zero_tail":
        k = rng.randint(1, min(n, 4096 + fmt.TRAILER_BYTES))
        data[n - k:] = bytes(k)
    elif kind == "append":
        data += rng.randbytes(rng.randint(1, 4096))
    return data


class _CorruptionWorld:
    def __init__(self, root: Path, checksum: Optional[int]):
        self.store = PageStore.open(root)
        self.xfers: dict[tuple[str, int], tuple[PageTransfer, Any]] = {}
        self.ns: dict[tuple[str, int], Any] = {}
        for gi, regions in enumerate(GEOMS):
            for which in ("main", "other"):
                ns = self.store.namespace(make_spec(regions, f"torture-{gi}-{which}", groups=2))
                self.ns[(which, gi)] = ns
                self.xfers[(which, gi)] = transfer_for(ns, checksum)

    def key(self, which: str, gi: int, g: int, i: int) -> bytes:
        return key_of("corrupt", gi, i)  # the same block key in both namespaces and both groups

    def close(self) -> None:
        for x, e in self.xfers.values():
            x.close()
            e.close()


def scenario_corruption(s: Settings, algo_label: str, checksum: Optional[int]) -> Row:
    row = Row("corruption", checksum=algo_label)
    d = fresh_dir(s, "corruption")
    root = d / "store"
    canary = Canary(d / "canary").create()
    canary.arm()
    try:
        w = _CorruptionWorld(root, checksum)
    except Exception as e:  # noqa: BLE001
        row.add("exc", f"set-up: {type(e).__name__}: {e}")
        return row
    rng = random.Random(1234 + (checksum or 0))
    pages = {}
    if checksum is not None:  # a legacy algorithm the library only reads: saves with it are refused
        x0, _ = w.xfers[("main", 0)]
        probe = x0.save_page(0, key_of("probe"), None, [page_bytes(1, GEOMS[0][0])])
        try:
            refused = probe.result(timeout=60) is SaveStatus.DROPPED
        except Exception as e:  # noqa: BLE001
            refused = False
            row.add("exc", f"save_page with the forced algorithm: {type(e).__name__}: {e}")
        if refused:
            row.skipped = f"saves with {algo_label} are refused (DROPPED): read-only legacy algorithm, not tested by saving"
            w.close()
            return row

    def page(which: str, gi: int, g: int, i: int) -> torch.Tensor:
        k = (which, gi, g, i)
        if k not in pages:
            pages[k] = page_bytes(rng.getrandbits(62), sum(GEOMS[gi]))
        return pages[k]

    def ensure(which: str, gi: int, g: int, i: int) -> Optional[str]:
        x, _ = w.xfers[(which, gi)]
        fut = x.save_page(g, w.key(which, gi, g, i), None, split(page(which, gi, g, i), GEOMS[gi]))
        try:
            st = fut.result(timeout=s.op_timeout * 5)
        except FutureTimeout:
            row.add("hang", "save did not resolve")
            return None
        except Exception as e:  # noqa: BLE001
            row.add("exc", f"save_page: {type(e).__name__}: {e}")
            return None
        if st not in (SaveStatus.PUBLISHED, SaveStatus.EXISTS):
            row.add("other", f"save of a fresh page was {st}")
            return None
        return w.ns[(which, gi)].chunk_path(g, w.key(which, gi, g, i))

    def qcount(ns: Any, g: int) -> int:
        q = ns.store.private / "quarantine" / ns.id / f"g{g}"
        try:
            return len(os.listdir(q))
        except OSError:
            return 0

    def load_and_judge(gi: int, g: int, i: int, mut: str, changed: bool) -> None:
        ns = w.ns[("main", gi)]
        x, _ = w.xfers[("main", gi)]
        path = ns.chunk_path(g, w.key("main", gi, g, i))
        q0 = qcount(ns, g)
        dst = torch.full((sum(GEOMS[gi]),), 0xA5, dtype=torch.uint8)
        fut = x.load_page(g, w.key("main", gi, g, i), split(dst, GEOMS[gi]))
        try:
            st = fut.result(timeout=s.op_timeout * 5)
        except FutureTimeout:
            row.add("hang", f"load after {mut}")
            return
        except Exception as e:  # noqa: BLE001
            row.add("exc", f"load after {mut}: {type(e).__name__}: {e}")
            return
        if st is LoadStatus.LOADED:
            if not torch.equal(dst, page("main", gi, g, i)):
                row.add("wrong", f"{mut} (page {GEOMS[gi]}) loaded as LOADED with wrong bytes")
            return
        if os.path.lexists(path):
            row.add("other", f"{mut}: load said {st.value} but the bad chunk was left in place")
        elif st is LoadStatus.CORRUPT and qcount(ns, g) <= q0:
            row.add("other", f"{mut}: CORRUPT but nothing arrived in the quarantine")
        elif st is LoadStatus.MISSING and changed:
            pass  # a miss is allowed; the chunk is out of the way

    for t in range(s.corruption_trials):
        gi = rng.randrange(len(GEOMS))
        g = rng.randrange(2)
        i = rng.randrange(CORRUPT_KEYS)
        mut = rng.choice(_mutations())
        path = ensure("main", gi, g, i)
        if path is None:
            continue
        targets = [(g, i)]
        payload = sum(GEOMS[gi])
        try:
            if mut == "swap_chunks":
                j = (i + 1 + rng.randrange(CORRUPT_KEYS - 1)) % CORRUPT_KEYS
                other = ensure("main", gi, g, j)
                if other is None:
                    continue
                a, b = Path(path).read_bytes(), Path(other).read_bytes()
                Path(path).write_bytes(b)
                Path(other).write_bytes(a)
                targets.append((g, j))
            elif mut in ("copy_namespace", "copy_group", "copy_key"):
                src = (ensure("other", gi, g, i) if mut == "copy_namespace" else
                       ensure("main", gi, 1 - g, i) if mut == "copy_group" else
                       ensure("main", gi, g, (i + 1) % CORRUPT_KEYS))
                if src is None:
                    continue
                Path(path).write_bytes(Path(src).read_bytes())
            else:
                raw = Path(path).read_bytes()
                new = _mutate(bytearray(raw), mut, payload, rng)
                with open(path, "r+b") as f:
                    f.write(new)
                    f.truncate(len(new))
        except OSError as e:
            row.add("other", f"harness could not mutate: {e}")
            continue
        row.trials += 1
        for gg, ii in targets:
            load_and_judge(gi, gg, ii, mut, True)
        for gg, ii in targets:  # the next trial starts from a pristine chunk
            p = w.ns[("main", gi)].chunk_path(gg, w.key("main", gi, gg, ii))
            if os.path.lexists(p):
                os.unlink(p)
    w.close()
    canary.check(row, "corruption")
    return row


# ================================================================================================
# 2. crash (SIGKILL mid-save)
# ================================================================================================
CRASH_REGIONS = [262144, 262144 + 100]
CRASH_SPEC = make_spec(CRASH_REGIONS, "torture-crash")


def _crash_page(seed: int, i: int) -> torch.Tensor:
    return page_bytes(seed * 1_000_003 + i, sum(CRASH_REGIONS))


def _crash_child(rep: Rep, root: str, seed: int) -> None:
    store = PageStore.open(root)
    ns = store.namespace(CRASH_SPEC)
    x, _ = transfer_for(ns, threads=4)
    pending: list[Any] = []
    i = 0
    while True:
        key = key_of("crash", seed, i)
        parent = key_of("crash", seed, i - 1) if i % 4 else None
        page = _crash_page(seed, i)
        fut = x.save_page(0, key, parent, split(page, CRASH_REGIONS))

        def done(f: Any, i: int = i, page: torch.Tensor = page) -> None:
            try:
                st = f.result()
            except BaseException as e:  # noqa: BLE001
                rep.ev("exc", f"save_page: {type(e).__name__}: {e}")
                return
            if st is SaveStatus.PUBLISHED or st is SaveStatus.EXISTS:
                rep.ev("data", f"pub {i}")
            else:
                rep.ev("data", f"{st.value} {i}")

        fut.add_done_callback(done)
        pending.append(fut)
        if len(pending) >= 6:
            try:
                pending.pop(0).result()
            except BaseException:  # noqa: BLE001 - reported by the callback
                pass
        i += 1


def scenario_crash(s: Settings) -> Row:
    row = Row("crash")
    per_store = 5 if s.fast else 10
    rng = random.Random(99)
    n_stores = max(1, (s.crash_trials + per_store - 1) // per_store)
    trial = 0
    for si in range(n_stores):
        d = fresh_dir(s, "crash")
        root = d / "store"
        PageStore.open(root).namespace(CRASH_SPEC)
        canary = Canary(d / "canary").create().arm()
        published: dict[tuple[int, int], bool] = {}
        attempted: dict[int, int] = {}
        for _ in range(per_store):
            if trial >= s.crash_trials:
                break
            seed = 1000 * si + trial
            trial += 1
            pid, evpath = spawn(_crash_child, str(root), seed)
            time.sleep(rng.uniform(0.05, 0.45))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            events = _read_events(evpath)
            os.unlink(evpath)
            top = -1
            for msg in row.apply(events):
                what, i = msg.split()
                top = max(top, int(i))
                if what == "pub":
                    published[(seed, int(i))] = True
            attempted[seed] = top
            row.trials += 1
        # every published chunk loads; every present chunk loads right or is a clean miss
        store = PageStore.open(root)
        ns = store.namespace(CRASH_SPEC)
        x, e = transfer_for(ns)
        known = {}
        for seed, top in attempted.items():
            for i in range(top + 64):
                known[ns.chunk_path(0, key_of("crash", seed, i))] = (seed, i)

        def load(seed: int, i: int) -> Optional[LoadStatus]:
            dst = torch.zeros(sum(CRASH_REGIONS), dtype=torch.uint8)
            try:
                st = x.load_page(0, key_of("crash", seed, i), split(dst, CRASH_REGIONS)).result(timeout=60)
            except Exception as err:  # noqa: BLE001
                row.add("exc", f"load: {type(err).__name__}: {err}")
                return None
            if st is LoadStatus.LOADED and not torch.equal(dst, _crash_page(seed, i)):
                row.add("wrong", "a chunk loaded after a crash has wrong bytes")
            return st

        for (seed, i) in published:
            st = load(seed, i)
            if st is not None and st is not LoadStatus.LOADED:
                row.add("lost", f"a chunk reported PUBLISHED before the kill loads {st.value}")
        for _, _, entry in store.iter_chunk_files([ns]):
            who = known.get(entry.path)
            if who is None:
                row.add("other", f"unknown chunk file after a crash: {entry.name}")
            elif who not in published:
                st = load(*who)
                if st is LoadStatus.CORRUPT:
                    row.add("other", "a published (renamed) chunk is torn after SIGKILL")
        x.close()
        e.close()
        # gc, as a fresh process: exactly the temp files go
        files, dirs = tree(root)
        temps = {f for f in files if fmt.TMP_MARK in os.path.basename(f)}
        r = run_cli(store_args(root) + ["gc", "--min-age", "0s", "--json"], s.cli_timeout * 2, real=True)
        judge_cli(row, r, "crash")
        if r.rc is not None:
            files2, dirs2 = tree(root)
            for f in sorted(temps & files2):
                row.add("other", f"gdskv gc left a dead writer's temp file {os.path.basename(f)}")
            for f in sorted(files - files2 - temps):
                row.add("lost" if "/c/" in f else "other", f"gdskv gc removed a non-temp file {f.split('/')[-1]}")
            for dd in sorted(dirs - dirs2):
                if "/c/" not in f"/{dd}":
                    row.add("other", f"gdskv gc removed directory {dd}")
            for f in sorted(files2 - files):
                if fmt.TMP_MARK not in f and "stats" not in f and "index" not in f:
                    row.add("other", f"gdskv gc created {f}")
        canary.check(row, "crash")
    return row


# ================================================================================================
# 3. full disk
# ================================================================================================
FULL_REGIONS = [262144]


def _full_child(rep: Rep, root: str, floor: Optional[int], n_saves: int, op_timeout: float) -> None:
    kw = {"min_free_bytes": floor} if floor else {}
    cfg = GdsKvConfig(store_path=root, o_direct="off", **kw)
    store = rep.guard("bring-up PageStore.open", PageStore.open, root, timeout=op_timeout)
    if store is None:
        return
    ns = rep.guard("bring-up namespace", store.namespace, make_spec(FULL_REGIONS, "torture-full"), timeout=op_timeout)
    if ns is None:
        return
    if floor:
        rep.guard("bring-up install_budget", install_budget, store, cfg, timeout=op_timeout)
    x, _ = transfer_for(ns, cfg=cfg)
    published = []
    drops = 0
    mount = os.path.dirname(root)
    min_free = None
    for i in range(n_saves):
        key = key_of("full", i)
        st = rep.result("save_page", x.save_page(0, key, None, [page_bytes(i, FULL_REGIONS[0])]), op_timeout)
        rep.ev("trial")
        free = shutil.disk_usage(mount).free
        min_free = free if min_free is None else min(min_free, free)
        if st is SaveStatus.PUBLISHED:
            published.append(i)
        elif st is SaveStatus.DROPPED:
            drops += 1
        if floor and free < floor:
            rep.ev("other", f"free space {free} below the configured floor {floor} after a save")
        if not floor and drops >= 5:
            break
    if not floor and drops == 0:
        rep.ev("other", "the disk never filled (no save was DROPPED)")
    # loads keep working (without a floor nothing evicts: every published chunk is still there)
    for i in published:
        dst = torch.zeros(FULL_REGIONS[0], dtype=torch.uint8)
        st = rep.result("load_page", x.load_page(0, key_of("full", i), [dst]), op_timeout)
        if st is LoadStatus.LOADED:
            if not torch.equal(dst, page_bytes(i, FULL_REGIONS[0])):
                rep.ev("wrong", "full disk: wrong bytes")
        elif st is not None and not floor:
            rep.ev("lost", f"full disk: a published chunk loads {st.value}")
    rep.guard("touch_many", ns.touch_many, 0, [key_of("full", i) for i in published], lease_seconds=5, timeout=op_timeout)
    rep.guard("contains_many", ns.contains_many, 0, [key_of("full", i) for i in range(20)], timeout=op_timeout)
    rep.guard("flush_stats", store.flush_stats, timeout=op_timeout)
    rep.guard("close", x.close, timeout=op_timeout)
    rep.ev("data", json.dumps({"published": len(published), "drops": drops, "min_free": min_free}))


def scenario_full_disk(s: Settings) -> Row:
    row = Row("full_disk")
    d = fresh_dir(s, "fulldisk")
    for phase, floor in (("no budget", None), ("free-space floor", 2 << 20)):
        mnt = d / f"mnt-{'floor' if floor else 'plain'}"
        why = mount_tmpfs(mnt, "8m")
        if why:
            row.skipped = why
            return row
        try:
            root = mnt / "store"
            canary = Canary(mnt / "canary").create()
            # a canary outside the file system too
            canary2 = Canary(d / f"canary-{'floor' if floor else 'plain'}").create()
            canary.arm()
            canary2.arm()
            run_child(row, f"full disk ({phase})", s.op_timeout * 30, _full_child, str(root), floor, 60 if floor else 200, s.op_timeout * 3)
            for t in temp_files(root):
                row.add("other", f"full disk ({phase}): temp file left after saves/stats: {os.path.basename(t)}")
            for args in (["stats"], ["info"], ["gc", "--min-age", "0s"], ["verify"], ["ls"], ["evict", "--max-bytes", "1M"]):
                judge_cli(row, run_cli(store_args(root) + args, s.cli_timeout, real=s.real_cli), f"full disk ({phase})")
                row.trials += 1
            for t in temp_files(root):
                row.add("other", f"full disk ({phase}): temp file left after housekeeping: {os.path.basename(t)}")
            canary.check(row, f"full disk ({phase})")
            canary2.check(row, f"full disk ({phase})")
        finally:
            umount(mnt)
    return row


# ================================================================================================
# 4. read-only store
# ================================================================================================
RO_REGIONS = [8192]


def _ro_child(rep: Rep, root: str, good: list[int], bad: list[int], op_timeout: float) -> None:
    cfg = GdsKvConfig(store_path=root, o_direct="off", max_bytes=1 << 20)
    store = rep.guard("bring-up PageStore.open (read-only)", PageStore.open, root, timeout=op_timeout, allowed=(StoreError,))
    if store is None:
        return
    ns = rep.guard("bring-up namespace (read-only)", store.namespace, make_spec(RO_REGIONS, "torture-ro"), timeout=op_timeout)
    if ns is None:
        return
    rep.guard("bring-up install_budget (read-only)", install_budget, store, cfg, timeout=op_timeout)
    t = rep.guard("bring-up collect_in_background (read-only)", collect_in_background, store, timeout=op_timeout)
    if t is not None:
        t.join(op_timeout)
        if t.is_alive():
            rep.ev("hang", "background gc on a read-only store")
    x, _ = transfer_for(ns, cfg=cfg)
    for i in good + bad:
        dst = torch.zeros(RO_REGIONS[0], dtype=torch.uint8)
        st = rep.result("load_page (read-only)", x.load_page(0, key_of("ro", i), [dst]), op_timeout)
        rep.ev("trial")
        if st is LoadStatus.LOADED and not torch.equal(dst, page_bytes(i, RO_REGIONS[0])):
            rep.ev("wrong", "read-only: a corrupt chunk loaded as LOADED")
        if i in good and st is not None and st is not LoadStatus.LOADED:
            rep.ev("lost", f"read-only: a sound chunk loads {st.value}")
    rep.guard("touch_many (read-only)", ns.touch_many, 0, [key_of("ro", i) for i in good], lease_seconds=5, timeout=op_timeout)
    rep.guard("contains_many (read-only)", ns.contains_many, 0, [key_of("ro", i) for i in good + bad], timeout=op_timeout)
    for i in range(100, 104):
        st = rep.result("save_page (read-only)", x.save_page(0, key_of("ro", i), None, [page_bytes(i, RO_REGIONS[0])]), op_timeout)
        rep.ev("trial")
        if st is SaveStatus.PUBLISHED:
            rep.ev("other", "read-only: a save reported PUBLISHED")
    rep.guard("close (read-only)", x.close, timeout=op_timeout)


def scenario_read_only(s: Settings) -> Row:
    row = Row("read_only")
    d = fresh_dir(s, "readonly")
    mnt = d / "mnt"
    why = mount_tmpfs(mnt, "32m")
    if why:
        row.skipped = why
        return row
    try:
        root = mnt / "store"
        store = PageStore.open(root)
        ns = store.namespace(make_spec(RO_REGIONS, "torture-ro"))
        x, e = transfer_for(ns, cfg=GdsKvConfig(store_path=str(root), o_direct="off"))
        for i in range(12):
            x.save_page(0, key_of("ro", i), None, [page_bytes(i, RO_REGIONS[0])]).result()
        x.close()
        e.close()
        good, bad = list(range(0, 12, 2)), list(range(1, 12, 2))
        for i in bad:
            p = ns.chunk_path(0, key_of("ro", i))
            raw = bytearray(Path(p).read_bytes())
            raw[i * 97] ^= 0x10
            Path(p).write_bytes(raw)
        Path(ns.chunk_path(0, key_of("ro", 0)) + f".tmp.{DEAD_PID}.1").write_bytes(b"leftover")
        canary = Canary(d / "canary").create().arm()
        why = remount(mnt, "ro")
        if why:
            row.skipped = why
            return row
        run_child(row, "read-only server", s.op_timeout * 20, _ro_child, str(root), good, bad, s.op_timeout)
        for args in (["verify", "--repair"], ["verify"], ["gc", "--min-age", "0s"], ["evict", "--max-bytes", "0"], ["ls"], ["info"], ["stats"]):
            judge_cli(row, run_cli(store_args(root) + args, s.cli_timeout, real=s.real_cli), "read-only")
            row.trials += 1
        canary.check(row, "read-only")
    finally:
        remount(mnt, "rw")
        umount(mnt)
    return row


# ================================================================================================
# 5. store removed while serving
# ================================================================================================
RM_REGIONS = [16384]


def _rm_server(rep: Rep, root: str, removed_flag: str, stop_flag: str, op_timeout: float) -> None:
    store = rep.guard("bring-up", PageStore.open, root, timeout=op_timeout)
    if store is None:
        return
    ns = rep.guard("namespace", store.namespace, make_spec(RM_REGIONS, "torture-rm"), timeout=op_timeout)
    if ns is None:
        return
    x, _ = transfer_for(ns, cfg=GdsKvConfig(store_path=root, o_direct="off"))
    published: list[int] = []
    i = 0
    rng = random.Random(os.getpid())
    while not os.path.exists(stop_flag):
        after_removal = os.path.exists(removed_flag)
        key = key_of("rm", root, i)
        st = rep.result("save_page", x.save_page(0, key, None, [page_bytes(seed_of(key), RM_REGIONS[0])]), op_timeout)
        if st is SaveStatus.PUBLISHED:
            present = os.path.exists(ns.chunk_path(0, key))
            root_ok = os.path.exists(os.path.join(root, "zarr.json"))
            if after_removal and not present:
                rep.ev("other", "a save after the store was removed reported PUBLISHED but its chunk is not there")
            elif after_removal and not root_ok:
                rep.ev("other", "a save after the store was removed was PUBLISHED into a tree without a root zarr.json")
            published.append(i)
        if published:
            j = rng.choice(published)
            k = key_of("rm", root, j)
            dst = torch.zeros(RM_REGIONS[0], dtype=torch.uint8)
            st = rep.result("load_page", x.load_page(0, k, [dst]), op_timeout)
            if st is LoadStatus.LOADED and not torch.equal(dst, page_bytes(seed_of(k), RM_REGIONS[0])):
                rep.ev("wrong", "store removed: wrong bytes")
        if i % 5 == 0:
            keys = [key_of("rm", root, j) for j in published[-8:]]
            rep.guard("contains_many", ns.contains_many, 0, keys, timeout=op_timeout)
            rep.guard("touch_many", ns.touch_many, 0, keys, lease_seconds=2, timeout=op_timeout)
        if i % 17 == 0:
            rep.guard("flush_stats", store.flush_stats, timeout=op_timeout)
        i += 1
        time.sleep(0.002)
    rep.guard("close", x.close, timeout=op_timeout)


def scenario_store_removed(s: Settings) -> Row:
    row = Row("store_removed")
    rng = random.Random(7)
    for t in range(s.removal_trials):
        d = fresh_dir(s, "removed")
        root = d / "store"
        PageStore.open(root).namespace(make_spec(RM_REGIONS, "torture-rm"))
        canary = Canary(d / "canary").create().arm()
        removed_flag, stop_flag = str(d / "removed.flag"), str(d / "stop.flag")
        pid, evpath = spawn(_rm_server, str(root), removed_flag, stop_flag, s.op_timeout)
        time.sleep(rng.uniform(0.2, 0.6))
        for _ in range(20):
            shutil.rmtree(root, ignore_errors=True)
            if not root.exists():
                break
        Path(removed_flag).touch()
        time.sleep(rng.uniform(0.3, 0.8))
        Path(stop_flag).touch()
        finished = wait_pid(pid, s.op_timeout * 10)
        row.apply(_read_events(evpath))
        os.unlink(evpath)
        if not finished:
            row.add("hang", "store removed: server did not stop")
        row.trials += 1
        if root.exists() and not (root / "zarr.json").exists():
            row.add("other", "store removed: the path is a half-made tree without a root zarr.json")
        canary.check(row, "store removed")
    return row


# ================================================================================================
# 6. concurrency with leases
# ================================================================================================
CC_REGIONS = [8192, 8192]
CC_CHUNK = sum(CC_REGIONS) + fmt.TRAILER_BYTES
CC_PROMPTS = 40
CC_BLOCKS = 8
LEASE_S = 3.0


def _cc_chain(p: int, salt: str) -> list[bytes]:
    from gdskv.keys import chain_keys

    rng = random.Random(f"{salt}/{p}")
    tokens = [rng.randrange(32000) for _ in range(16 * CC_BLOCKS)]
    return chain_keys(tokens, 16, salt)


def _cc_server(rep: Rep, root: str, seconds: float, salt: str, leases: bool, op_timeout: float) -> None:
    cfg = GdsKvConfig(store_path=root, max_bytes=60 * CC_CHUNK, o_direct="off")
    store = rep.guard("bring-up PageStore.open", PageStore.open, root, timeout=op_timeout)
    if store is None:
        return
    ns = rep.guard("bring-up namespace", store.namespace, make_spec(CC_REGIONS, "torture-cc"), timeout=op_timeout)
    if ns is None:
        return
    rep.guard("bring-up install_budget", install_budget, store, cfg, timeout=op_timeout * 3)
    x, _ = transfer_for(ns, cfg=cfg)
    chains = [_cc_chain(p, salt) for p in range(CC_PROMPTS)]
    rng = random.Random(salt)
    tally = {"lookups": 0, "loads": 0, "loaded": 0, "leased_checks": 0, "saves": 0, "published": 0, "dropped": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        keys = chains[rng.randrange(CC_PROMPTS)]
        rep.ev("trial")
        tally["lookups"] += 1
        present = rep.guard("contains_many", ns.contains_many, 0, keys, timeout=op_timeout) or []
        n = 0
        while n < len(present) and present[n]:
            n += 1
        leased: set[int] = set()
        lease_until = 0.0
        if n and leases:
            rep.guard("touch_many", ns.touch_many, 0, keys[:n], lease_seconds=LEASE_S, timeout=op_timeout)
            lease_until = time.time() + LEASE_S
            floor = time.time_ns() + int(LEASE_S * 0.5e9)
            for j in range(n):
                try:
                    if os.stat(ns.chunk_path(0, keys[j])).st_atime_ns > floor:
                        leased.add(j)
                except OSError:
                    pass
            time.sleep(rng.uniform(0, 0.3))
        for j in range(n):
            path = ns.chunk_path(0, keys[j])
            still_leased = j in leased and time.time() < lease_until - 0.5
            tally["leased_checks"] += still_leased
            tally["loads"] += 1
            if still_leased and not os.path.exists(path):
                rep.ev("lost", "a leased chunk vanished before its lease ran out")
                still_leased = False
            dst = torch.zeros(sum(CC_REGIONS), dtype=torch.uint8)
            st = rep.result("load_page", x.load_page(0, keys[j], split(dst, CC_REGIONS)), op_timeout)
            if st is LoadStatus.LOADED:
                tally["loaded"] += 1
                if not torch.equal(dst, page_bytes(seed_of(keys[j]), sum(CC_REGIONS))):
                    rep.ev("wrong", "concurrency: wrong bytes")
            elif st is not None and still_leased and time.time() < lease_until - 0.5:
                rep.ev("lost", f"a leased chunk loads {st.value} within its lease")
            if st is not LoadStatus.LOADED:
                n = j
                break
        for j in range(n, len(keys)):
            page = page_bytes(seed_of(keys[j]), sum(CC_REGIONS))
            st = rep.result("save_page", x.save_page(0, keys[j], keys[j - 1] if j else None, split(page, CC_REGIONS)), op_timeout)
            tally["saves"] += 1
            tally["published"] += st is SaveStatus.PUBLISHED
            tally["dropped"] += st is SaveStatus.DROPPED
    rep.ev("data", f"{salt}: " + ", ".join(f"{k} {v}" for k, v in tally.items()))
    rep.guard("close", x.close, timeout=op_timeout)


def scenario_concurrency(s: Settings) -> Row:
    row = Row("concurrency")
    d = fresh_dir(s, "concurrency")
    root = d / "store"
    PageStore.open(root).namespace(make_spec(CC_REGIONS, "torture-cc"))
    canary = Canary(d / "canary").create().arm()
    server = spawn(_cc_server, str(root), s.seconds, "server", True, s.op_timeout)
    writer = spawn(_cc_server, str(root), s.seconds, "writer", False, s.op_timeout)
    stop = threading.Event()
    lock = threading.Lock()
    results: list[CliResult] = []

    def loop(args: list[str]) -> None:
        while not stop.is_set():
            r = run_cli(store_args(root) + args, s.cli_timeout, real=s.real_cli)
            with lock:
                results.append(r)
            stop.wait(0.05)

    threads = [threading.Thread(target=loop, args=(a,), daemon=True) for a in
               (["evict", "--max-bytes", str(25 * CC_CHUNK), "--json"], ["gc", "--min-age", "0s", "--json"])]
    for t in threads:
        t.start()
    for pid, evpath in (server, writer):
        finished = wait_pid(pid, s.seconds + s.op_timeout * 10)
        row.notes += row.apply(_read_events(evpath))
        os.unlink(evpath)
        if not finished:
            row.add("hang", "concurrency: a server did not finish")
    stop.set()
    for t in threads:
        t.join(s.cli_timeout * 2)
    evicted = runs = 0
    for r in results:
        judge_cli(row, r, "concurrency")
        if r.args[2] == "evict" and r.rc in (0, 1):
            runs += 1
            try:
                evicted += json.loads(r.out).get("removed", 0)
            except ValueError:
                pass
    row.notes.append(f"gdskv evict ran {runs} times and removed {evicted} chunks; gdskv gc ran "
                     f"{sum(r.args[2] == 'gc' for r in results)} times")
    canary.check(row, "concurrency")
    return row


# ================================================================================================
# 7. escapes (links and metadata that point outside the store)
# ================================================================================================
ESC_REGIONS = [4096]
ESC_SPEC = make_spec(ESC_REGIONS, "torture-esc")
ESC_KEYS = 6


def _esc_server(rep: Rep, root: str, extra_keys: list[str], op_timeout: float) -> None:
    """Connector-style bring-up, then loads, leases, saves, lookups and a stats flush."""
    cfg = GdsKvConfig(store_path=root, max_bytes=3 * (ESC_REGIONS[0] + fmt.TRAILER_BYTES), o_direct="off")
    store = rep.guard("bring-up PageStore.open", PageStore.open, root, timeout=op_timeout, allowed=(StoreError,))
    if store is None:
        return
    ns = rep.guard("bring-up namespace", store.namespace, ESC_SPEC, timeout=op_timeout, allowed=(StoreError,))
    if ns is None:
        return
    rep.guard("bring-up install_budget", install_budget, store, cfg, timeout=op_timeout)
    t = rep.guard("bring-up collect_in_background", collect_in_background, store, timeout=op_timeout)
    if t is not None:
        t.join(op_timeout)
        if t.is_alive():
            rep.ev("hang", "background gc at bring-up")
    rep.guard("namespaces()", store.namespaces, timeout=op_timeout)
    x, _ = transfer_for(ns, cfg=cfg)
    keys = [key_of("esc", i) for i in range(ESC_KEYS)] + [bytes.fromhex(k) for k in extra_keys]
    rep.guard("contains_many", ns.contains_many, 0, keys, timeout=op_timeout)
    rep.guard("touch_many", ns.touch_many, 0, keys, lease_seconds=30, timeout=op_timeout)
    for k in keys:
        dst = torch.zeros(ESC_REGIONS[0], dtype=torch.uint8)
        st = rep.result("load_page", x.load_page(0, k, [dst]), op_timeout)
        rep.ev("trial")
        if st is LoadStatus.LOADED and not torch.equal(dst, page_bytes(seed_of(k), ESC_REGIONS[0])):
            rep.ev("wrong", "escape: a page loaded from a file that is not its chunk")
    for i in range(ESC_KEYS, ESC_KEYS + 6):
        k = key_of("esc", i)
        rep.result("save_page", x.save_page(0, k, key_of("esc", i - 1), [page_bytes(seed_of(k), ESC_REGIONS[0])]), op_timeout)
        rep.ev("trial")
    for i in range(ESC_KEYS):  # saves over what is there (links included)
        k = key_of("esc", i)
        rep.result("save_page", x.save_page(0, k, None, [page_bytes(seed_of(k), ESC_REGIONS[0])]), op_timeout)
    rep.guard("flush_stats", store.flush_stats, timeout=op_timeout)
    rep.guard("close", x.close, timeout=op_timeout)


def _ns_json(spec_json: dict) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": {"gdskv_namespace": spec_json}}


def _plant_namespace(root: Path, spec_json: dict, dir_name: Optional[str] = None, make: tuple[str, ...] = ()) -> Path:
    """Write a namespace group ``zarr.json`` (at the id its spec hashes to, when it parses)."""
    if dir_name is None:
        try:
            dir_name = NamespaceSpec.from_json(spec_json).namespace_id
        except Exception:  # noqa: BLE001
            dir_name = hashlib.sha256(json.dumps(spec_json, sort_keys=True, default=str).encode()).hexdigest()[:16]
    d = root / "ns" / dir_name
    d.mkdir(parents=True, exist_ok=True)
    (d / "zarr.json").write_text(json.dumps(_ns_json(spec_json)))
    for m in make:
        (d / m).mkdir(parents=True, exist_ok=True)
    return d


def _escape_setups(canary_name: str) -> list[tuple[str, Callable[[Path, Any, Path], list[str]]]]:
    base = ESC_SPEC.to_json()
    chunk = ESC_REGIONS[0] + fmt.TRAILER_BYTES

    def private_link(root: Path, ns: Any, canary: Path) -> list[str]:
        shutil.rmtree(root / ".gdskv")
        os.symlink(canary, root / ".gdskv")
        return []

    def c_link(root: Path, ns: Any, canary: Path) -> list[str]:
        c = ns.array_path(0) / "c"
        shutil.rmtree(c)
        os.symlink(canary, c)
        return []

    def hi_link(root: Path, ns: Any, canary: Path) -> list[str]:
        p = Path(ns.chunk_path(0, key_of("esc", 0)))
        hi = p.parent.parent
        shutil.rmtree(hi)
        os.symlink(canary, hi)
        os.symlink(canary, hi.parent / "4095")
        return []

    def chunk_link(root: Path, ns: Any, canary: Path) -> list[str]:
        for i, target in ((0, canary / "1"), (1, canary / "0" / "0"), (2, canary / "0")):
            p = Path(ns.chunk_path(0, key_of("esc", i)))
            p.unlink()
            os.symlink(target, p)
        return []

    def lgid_up(root: Path, ns: Any, canary: Path) -> list[str]:
        j = dict(base, model="torture-esc-lgid")
        j["groups"] = [dict(base["groups"][0], layer_group_id=f"0/../../../../{canary_name}", bytes_per_page=ESC_REGIONS[0])]
        _plant_namespace(root, j, make=("g0",))
        j2 = dict(base, model="torture-esc-lgid2")
        j2["groups"] = [dict(base["groups"][0], layer_group_id=f"/../../../../{canary_name}/x")]
        _plant_namespace(root, j2, make=("g",))
        j3 = dict(base, model="torture-esc-lgid3")
        j3["groups"] = [dict(base["groups"][0], layer_group_id=f"/../../../{canary_name}/x")]
        _plant_namespace(root, j3, make=("g",))
        return []

    def groups_bad(root: Path, ns: Any, canary: Path) -> list[str]:
        variants = [
            {k: v for k, v in base.items() if k != "groups"},
            dict(base, groups="g0"),
            dict(base, groups=[5]),
            dict(base, groups=[{"layer_group_id": "x", "bytes_per_page": "big", "layer_ids": 5}]),
            dict(base, groups=None),
            dict(base, groups=[dict(base["groups"][0], bytes_per_page=chunk * 2)]),  # claims other dimensions
            dict(base, groups=[dict(base["groups"][0], bytes_per_page=-4096)]),
        ]
        for i, v in enumerate(variants):
            _plant_namespace(root, v, dir_name=f"{i:016x}", make=("g0",))
        # and the real namespace's own metadata rewritten to claim other dimensions
        real = ns.path / "zarr.json"
        meta = json.loads(real.read_text())
        meta["attributes"]["gdskv_namespace"]["groups"][0]["bytes_per_page"] = chunk
        real.write_text(json.dumps(meta))
        return []

    return [("private dir link", private_link), ("c/ link", c_link), ("c/<hi> link", hi_link), ("chunk link", chunk_link),
            ("layer_group_id path", lgid_up), ("bad groups", groups_bad)]


ESC_CLI = [["gc", "--min-age", "0s"], ["gc", "--min-age", "0s", "--grace", "0s"], ["evict", "--max-bytes", "0"],
           ["verify", "--repair"], ["ls"], ["info"], ["stats"]]


def _esc_store(d: Path, canary_size: int) -> tuple[Path, Any, Canary]:
    root = d / "store"
    store = PageStore.open(root)
    ns = store.namespace(ESC_SPEC)
    x, e = transfer_for(ns, cfg=GdsKvConfig(store_path=str(root), o_direct="off"))
    for i in range(ESC_KEYS):
        k = key_of("esc", i)
        x.save_page(0, k, key_of("esc", i - 1) if i else None, [page_bytes(seed_of(k), ESC_REGIONS[0])]).result()
    x.close()
    e.close()
    canary = Canary(d / "canary", chunk_size=canary_size).create()
    return root, ns, canary


def scenario_escapes(s: Settings) -> Row:
    row = Row("escapes")
    for name, setup in _escape_setups("canary"):
        d = fresh_dir(s, "escapes")
        root, ns, canary = _esc_store(d, ESC_REGIONS[0] + fmt.TRAILER_BYTES)
        try:
            extra = setup(root, ns, canary.path)
        except OSError as e:
            row.add("other", f"{name}: harness set-up failed: {e}")
            continue
        canary.arm()
        run_child(row, f"escapes/{name}: server", s.op_timeout * 25, _esc_server, str(root), extra, s.op_timeout)
        canary.check(row, f"{name}: server")
        for args in ESC_CLI:
            judge_cli(row, run_cli(store_args(root) + args, s.cli_timeout, real=s.real_cli), f"{name}")
            row.trials += 1
            canary.check(row, f"{name}: gdskv {args[0]}")
    return row


# ================================================================================================
# 8. hostile files
# ================================================================================================
def _hostile_setups() -> list[tuple[str, Callable[[Path, Any], list[socket.socket]]]]:
    def at(ns: Any, i: int) -> Path:
        p = Path(ns.chunk_path(0, key_of("esc", i)))
        p.unlink()
        return p

    def fifo(root: Path, ns: Any) -> list:
        os.mkfifo(at(ns, 0))
        return []

    def directory(root: Path, ns: Any) -> list:
        p = at(ns, 1)
        p.mkdir()
        (p / "inner").write_bytes(b"x" * 10)
        return []

    def sock(root: Path, ns: Any) -> list:
        sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        short = f"/tmp/gdskv-torture-{os.getpid()}.sock"  # AF_UNIX limits a bound path's length
        sk.bind(short)
        os.rename(short, at(ns, 2))
        return [sk]

    def devzero(root: Path, ns: Any) -> list:
        os.symlink("/dev/zero", at(ns, 3))
        return []

    def fifo_index(root: Path, ns: Any) -> list:
        idx = root / ".gdskv" / "index"
        idx.mkdir(parents=True, exist_ok=True)
        os.mkfifo(idx / f"{ns.id}.g0.npy")
        st = root / ".gdskv" / "stats"
        st.mkdir(parents=True, exist_ok=True)
        os.mkfifo(st / "host-1-1.json")
        return []

    return [("FIFO chunk", fifo), ("directory chunk", directory), ("socket chunk", sock), ("/dev/zero link chunk", devzero),
            ("FIFO index and stats files", fifo_index)]


HOSTILE_CLI = [["evict", "--max-bytes", "0"], ["ls"], ["verify"], ["verify", "--repair"], ["gc", "--min-age", "0s"], ["info"], ["stats"]]


def scenario_hostile(s: Settings) -> Row:
    row = Row("hostile_files")
    for name, setup in _hostile_setups():
        d = fresh_dir(s, "hostile")
        root, ns, canary = _esc_store(d, ESC_REGIONS[0] + fmt.TRAILER_BYTES)
        socks = setup(root, ns)
        canary.arm()
        run_child(row, f"hostile/{name}: server", s.op_timeout * 25, _esc_server, str(root), [], s.op_timeout)
        for args in HOSTILE_CLI:
            judge_cli(row, run_cli(store_args(root) + args, s.cli_timeout, real=s.real_cli), name)
            row.trials += 1
        canary.check(row, name)
        for sk in socks:
            sk.close()
    return row


# ================================================================================================
# 9. malformed metadata and config
# ================================================================================================
def _bringup_child(rep: Rep, cfg_path: Optional[str], store_path: str, op_timeout: float) -> None:
    def bring_up() -> None:
        cfg = load_config(cfg_path, store_path=None if cfg_path else store_path)
        store = PageStore.open(cfg.store_path)
        install_budget(store, cfg)
        ns = store.namespace(ESC_SPEC)
        store.namespaces()
        collect_in_background(store).join(op_timeout)
        ns.contains_many(0, [key_of("esc", 0)])
        ns.touch_many(0, [key_of("esc", 0)], lease_seconds=5)
        from gdskv.eviction import scan_store

        scan_store(store)
        x, e = transfer_for(ns, cfg=cfg)
        dst = torch.zeros(ESC_REGIONS[0], dtype=torch.uint8)
        rep.result("load_page", x.load_page(0, key_of("esc", 0), [dst]), op_timeout)
        x.close()
        e.close()

    rep.guard("bring-up", bring_up, timeout=op_timeout * 3, allowed=(ConfigError, StoreError))
    rep.ev("trial")


def _ns_variants() -> list[tuple[str, bytes]]:
    base = ESC_SPEC.to_json()
    g0 = base["groups"][0]

    def j(spec: Any) -> bytes:
        return json.dumps(_ns_json(spec)).encode()

    return [
        ("invalid JSON", b"{\"attributes\": {"),
        ("non-UTF-8", b"\xff\xfe\x00garbage\xc3"),
        ("empty", b""),
        ("top-level list", b"[]"),
        ("attributes null", json.dumps({"attributes": None}).encode()),
        ("attributes list", json.dumps({"attributes": [1]}).encode()),
        ("spec empty", j({})),
        ("spec a string", j("model")),
        ("model missing", j({k: v for k, v in base.items() if k != "model"})),
        ("model a number", j(dict(base, model=5))),
        ("tokens_per_block a string", j(dict(base, tokens_per_block="x"))),
        ("tokens_per_block negative", j(dict(base, tokens_per_block=-16))),
        ("tp_rank huge", j(dict(base, tp_rank=10**30))),
        ("extra a list", j(dict(base, extra=[1, 2]))),
        ("layer_ids an int", j(dict(base, groups=[dict(g0, layer_ids=5)]))),
        ("bytes_per_page huge", j(dict(base, groups=[dict(g0, bytes_per_page=10**30)]))),
        ("bytes_per_page negative", j(dict(base, groups=[dict(g0, bytes_per_page=-1)]))),
        ("layer_group_id huge", j(dict(base, groups=[dict(g0, layer_group_id=2**70)]))),
        ("layer_group_id negative", j(dict(base, groups=[dict(g0, layer_group_id=-1)]))),
        ("layer_group_id float", j(dict(base, groups=[dict(g0, layer_group_id=0.5)]))),
        ("window_size a string", j(dict(base, groups=[dict(g0, window_size="w")]))),
        ("groups empty", j(dict(base, groups=[]))),
    ]


def _root_variants() -> list[tuple[str, Optional[bytes]]]:
    def j(x: Any) -> bytes:
        return json.dumps(x).encode()

    grp = {"zarr_format": 3, "node_type": "group"}
    return [
        ("invalid JSON", b"{"),
        ("non-UTF-8", b"\xff\xfe\xfd"),
        ("empty file", b""),
        ("top-level list", b"[]"),
        ("attributes a list", j(dict(grp, attributes=[]))),
        ("gdskv a number", j(dict(grp, attributes={"gdskv": 5}))),
        ("gdskv empty", j(dict(grp, attributes={"gdskv": {}}))),
        ("format_version a string", j(dict(grp, attributes={"gdskv": {"format_version": "1"}}))),
        ("format_version huge", j(dict(grp, attributes={"gdskv": {"format_version": 2**80}}))),
        ("zarr.json a directory", None),
    ]


def _config_variants(store: str) -> list[tuple[str, Optional[bytes], bool]]:
    sp = f"store_path = {json.dumps(store)}\n".encode()
    return [
        ("gdskv = 5", sp + b"gdskv = 5\n", True),
        ("gdskv = \"x\"", b"gdskv = \"x\"\n", True),
        ("[gdskv] table with store_path = 5", b"[gdskv]\nstore_path = 5\n", True),
        ("non-UTF-8", sp + b"model_id = \"\xff\xfe\"\n", True),
        ("store_path = 5", b"store_path = 5\n", True),
        ("stats_flush_seconds = true", sp + b"stats_flush_seconds = true\n", True),
        ("max_bytes = 1.5", sp + b"max_bytes = 1.5\n", True),
        ("max_bytes = -1", sp + b"max_bytes = -1\n", True),
        ("max_bytes = \"lots\"", sp + b"max_bytes = \"lots\"\n", True),
        ("min_free_percent = nan", sp + b"min_free_percent = nan\n", True),
        ("io_threads = 1e3", sp + b"io_threads = 1e3\n", True),
        ("engine = [\"posix\"]", sp + b"engine = [\"posix\"]\n", True),
        ("o_direct = 3", sp + b"o_direct = 3\n", True),
        ("model_id = 7", sp + b"model_id = 7\n", True),
        ("stats_flush_seconds = inf", sp + b"stats_flush_seconds = inf\n", True),
        ("unknown key", sp + b"colour = \"blue\"\n", True),
        ("not TOML", b"this is = = not toml\n", True),
        ("config path is a directory", None, True),
        ("valid", sp, False),
    ]


MALFORMED_CLI = [["info"], ["ls"], ["stats"], ["verify"], ["gc", "--min-age", "0s"], ["evict", "--max-bytes", "0"]]


def scenario_malformed(s: Settings) -> Row:
    row = Row("malformed")
    cli = MALFORMED_CLI if not s.fast else [["info"], ["ls"], ["verify"], ["evict", "--max-bytes", "0"]]
    # namespace metadata: bring-up ignores the namespace (or raises StoreError); the CLI keeps going
    d = fresh_dir(s, "malformed-ns")
    root, ns, canary = _esc_store(d, 100)
    for i, (name, raw) in enumerate(_ns_variants()):
        nd = root / "ns" / f"bad{i:013d}"
        nd.mkdir(parents=True)
        (nd / "zarr.json").write_bytes(raw)
        (nd / "g0" / "c" / "0" / "0").mkdir(parents=True)
    canary.arm()
    run_child(row, "malformed namespaces: bring-up", s.op_timeout * 10, _bringup_child, None, str(root), s.op_timeout)
    for args in cli:
        judge_cli(row, run_cli(store_args(root) + args, s.cli_timeout, real=s.real_cli), "malformed namespaces")
        row.trials += 1
    # each variant alone, bring-up only (one child each is cheap)
    for i, (name, raw) in enumerate(_ns_variants()):
        d1 = fresh_dir(s, "malformed-ns1")
        r1, ns1, _ = _esc_store(d1, 100)
        nd = r1 / "ns" / "badbadbadbadbad0"
        nd.mkdir(parents=True)
        (nd / "zarr.json").write_bytes(raw)
        sub = Row("x")
        run_child(sub, "", s.op_timeout * 10, _bringup_child, None, str(r1), s.op_timeout)
        for f in COUNTS:
            if getattr(sub, f):
                row.add(next(k for k, v in KIND_TO_FIELD.items() if v == f), f"namespace zarr.json {name}: " + (sub.details[0] if sub.details else ""), getattr(sub, f))
        row.trials += 1
        if not s.fast:
            for args in cli:
                judge_cli(row, run_cli(store_args(r1) + args, s.cli_timeout, real=s.real_cli), f"namespace zarr.json {name}")
    canary.check(row, "malformed namespaces")
    # root metadata: bring-up raises StoreError; the CLI says so in one line, exit 2
    for name, raw in _root_variants():
        d2 = fresh_dir(s, "malformed-root")
        r2, _, canary2 = _esc_store(d2, 100)
        (r2 / "zarr.json").unlink()
        if raw is None:
            (r2 / "zarr.json").mkdir()
        else:
            (r2 / "zarr.json").write_bytes(raw)
        canary2.arm()
        sub = Row("x")
        run_child(sub, "", s.op_timeout * 10, _bringup_child, None, str(r2), s.op_timeout)
        for f in COUNTS:
            if getattr(sub, f):
                row.add(next(k for k, v in KIND_TO_FIELD.items() if v == f), f"root zarr.json {name}: " + (sub.details[0] if sub.details else ""), getattr(sub, f))
        row.trials += 1
        for args in cli[:2] if s.fast else cli:
            judge_cli(row, run_cli(store_args(r2) + args, s.cli_timeout, real=s.real_cli), f"root zarr.json {name}", expect_usage_error=True)
            row.trials += 1
        canary2.check(row, f"root zarr.json {name}")
    # config files: bring-up raises ConfigError; the CLI exits 2 with one line
    d3 = fresh_dir(s, "malformed-config")
    r3, _, canary3 = _esc_store(d3, 100)
    canary3.arm()
    for i, (name, raw, invalid) in enumerate(_config_variants(str(r3))):
        cp = d3 / f"config-{i}.toml"
        if raw is None:
            cp.mkdir()
        else:
            cp.write_bytes(raw)
        sub = Row("x")
        run_child(sub, "", s.op_timeout * 10, _bringup_child, str(cp), str(r3), s.op_timeout)
        for f in COUNTS:
            if getattr(sub, f):
                row.add(next(k for k, v in KIND_TO_FIELD.items() if v == f), f"config {name}: " + (sub.details[0] if sub.details else ""), getattr(sub, f))
        if invalid:
            try:
                load_config(str(cp))
                row.add("other", f"config {name}: load_config accepted it")
            except ConfigError:
                pass
            except Exception as e:  # noqa: BLE001
                row.add("exc", f"config {name}: load_config raised {type(e).__name__}: {e}")
        row.trials += 1
        for args in (["info"],) if s.fast else (["info"], ["evict"], ["stats"]):
            judge_cli(row, run_cli(list(args), s.cli_timeout, env={"GDSKV_CONFIG": str(cp)}, real=s.real_cli),
                      f"config {name}", expect_usage_error=invalid)
            row.trials += 1
    canary3.check(row, "malformed config")
    return row


# ================================================================================================
# driver
# ================================================================================================
SCENARIOS = ["corruption", "crash", "full_disk", "read_only", "store_removed", "concurrency", "escapes", "hostile_files", "malformed"]


def run_scenario(name: str, s: Settings) -> list[Row]:
    t0 = time.monotonic()
    rows: list[Row]
    if name == "corruption":
        rows = []
        for label, algo in checksum_algorithms():
            t1 = time.monotonic()
            try:
                r = scenario_corruption(s, label, algo)
            except Exception as e:  # noqa: BLE001 - a harness-level failure is reported, not hidden
                r = Row("corruption", checksum=label)
                r.add("exc", f"scenario aborted: {type(e).__name__}: {e}")
            r.seconds = time.monotonic() - t1
            rows.append(r)
        return rows
    fn = {"crash": scenario_crash, "full_disk": scenario_full_disk, "read_only": scenario_read_only,
          "store_removed": scenario_store_removed, "concurrency": scenario_concurrency, "escapes": scenario_escapes,
          "hostile_files": scenario_hostile, "malformed": scenario_malformed}[name]
    try:
        r = fn(s)
    except Exception as e:  # noqa: BLE001
        r = Row(name)
        r.add("exc", f"scenario aborted: {type(e).__name__}: {e} ({traceback.format_exc(limit=2).splitlines()[-2].strip()})")
    r.seconds = time.monotonic() - t0
    return [r]


def format_table(rows: list[Row]) -> str:
    head = ["scenario", "checksum", "trials", "wrong loads", "exceptions", "lost published/leased", "outside store", "hangs", "other", "seconds"]
    body = []
    for r in rows:
        if r.skipped:
            body.append([r.scenario, r.checksum, "skipped", "-", "-", "-", "-", "-", "-", f"{r.seconds:.1f}"])
        else:
            body.append([r.scenario, r.checksum, str(r.trials), *(str(getattr(r, f)) for f in COUNTS), f"{r.seconds:.1f}"])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body]
    for r in rows:
        if r.skipped:
            out.append(f"\n{r.scenario}: skipped: {r.skipped}")
        elif r.details or r.notes:
            out.append(f"\n{r.scenario} [{r.checksum}]:")
            out += [f"  - {d}" for d in r.details]
            out += [f"  (note) {n}" for n in r.notes]
    return "\n".join(out)


def run(names: list[str], s: Settings) -> list[Row]:
    quiet_library()
    rows = []
    for name in names:
        s.log(f"torture: {name} ...")
        got = run_scenario(name, s)
        for r in got:
            s.log(f"torture: {name} [{r.checksum}] {r.seconds:.1f}s: " + (f"skipped ({r.skipped})" if r.skipped else
                  ", ".join(f"{f}={getattr(r, f)}" for f in COUNTS) + f", trials={r.trials}"))
        rows += got
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="small trial counts (the CI variant)")
    ap.add_argument("--only", action="append", choices=SCENARIOS, help="run only this scenario (repeatable)")
    ap.add_argument("--seconds", type=float, default=None, help="length of the concurrency run (default 120, --fast 8)")
    ap.add_argument("--dir", default=None, help="where stores are made (default: a new temp dir, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the stores made")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    ap.add_argument("--real-cli", action="store_true", help="run every gdskv command as a fresh python process")
    a = ap.parse_args(argv)
    for name in [k for k in os.environ if k.startswith("GDSKV_")]:
        # every store and config here is named explicitly; an inherited GDSKV_STORE / GDSKV_CONFIG
        # would override them in the processes this harness starts
        print(f"torture: ignoring {name} from the environment", file=sys.stderr)
        del os.environ[name]
    if a.dir:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="gdskv-torture-", dir=a.dir))
    s = Settings.make(a.fast, base, a.seconds, a.real_cli)
    t0 = time.monotonic()
    try:
        rows = run(a.only or SCENARIOS, s)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    ok = not any(r.failed for r in rows)
    if a.json:
        print(json.dumps({"ok": ok, "fast": a.fast, "seconds": time.monotonic() - t0, "rows": [r.as_json() for r in rows]}, indent=1))
    else:
        print(format_table(rows))
        print(f"\n{'OK' if ok else 'FAILED'} in {time.monotonic() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    with sigterm_as_exit():
        sys.exit(main())
