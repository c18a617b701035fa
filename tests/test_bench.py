"""``gdskv.bench.ChunkWriter``: benchmark stores are filled through the transfer's one chunk writer."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from gdskv.bench import ChunkWriter, FilePerPage, Subject, measure
from gdskv.io.posix import PosixEngine
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer

PAGE = 64


def test_chunk_writer_publishes_chunks_a_load_verifies(tmp_path: Path) -> None:
    ns = PageStore.open(tmp_path / "store").namespace(
        NamespaceSpec(model="bench", dtype="uint8", tokens_per_block=1, groups=(GroupSpec(0, PAGE, (0,), None),)))
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(20)]
    with ChunkWriter(ns, threads=2, window=7) as writer:
        paths = [writer.write(0, k, keys[i - 1] if i else None, bytes([i]) * PAGE) for i, k in enumerate(keys)]
    assert paths == [ns.chunk_path(0, k) for k in keys]
    assert ns.contains_many(0, keys) == [True] * len(keys)
    assert not list((tmp_path / "store").rglob("*.tmp.*")), "temp files left behind"
    engine = PosixEngine(threads=1)
    xfer = PageTransfer(ns, engine, threads=1)
    try:
        page = torch.zeros(PAGE, dtype=torch.uint8)
        assert xfer.load_page(0, keys[5], [page]).result() is LoadStatus.LOADED
        assert bytes(page.numpy()) == bytes([5]) * PAGE
    finally:
        xfer.close()
        engine.close()


def test_a_peer_without_its_virtualenv_is_left_out_with_the_reason(tmp_path: Path, monkeypatch) -> None:
    """vLLM's virtualenv is never made by the bench: where it is missing, the run goes on without
    it and the report says why."""
    from gdskv.bench import BenchOptions, format_report, run

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    report = run(BenchOptions(directory=str(tmp_path), total_bytes=256 << 10, page_sizes=(64 << 10,), rounds=1,
                              engines=("posix+o_direct",), peers=("vllm",), baselines=False))
    assert "no usable virtualenv" in report["skipped"]["peer vllm"]
    assert [r["subject"] for r in report["results"]] == ["store:posix+o_direct@torch", "service:host-tier@torch"]
    assert "peer vllm left out" in format_report(report)


def test_the_report_says_whether_the_torch_pools_pages_move_in_place_or_staged(tmp_path: Path) -> None:
    """The bench reports the direct-I/O alignment of its directory's file system (statx) and
    where each torch pool started, and says which way its pages moved: the key to reading its
    cold loads against peers whose memory is page-aligned."""
    from gdskv.bench import BenchOptions, format_report, run
    from test_transfer_batch import _dio_mem_align

    report = run(BenchOptions(directory=str(tmp_path), total_bytes=128 << 10, page_sizes=(64 << 10,), rounds=1,
                              engines=("posix+o_direct",), peers=(), baselines=False, service=False))
    dio = report["direct_io"]
    [(page, offset)] = dio["torch_pool_offsets"].items()
    assert page == 64 << 10 and 0 <= offset < 4096
    text = " ".join(format_report(report).split())
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    mem = _dio_mem_align(probe) if os.uname().machine == "x86_64" else None
    if mem:
        assert dio["memory_align"] == mem and f"{mem}-byte-aligned memory moves in place" in text
        assert f"64K pages +{offset} B ({'in place' if offset % mem == 0 else 'staged'})" in text
    else:
        assert "direct I/O:" in text


def test_round_directories_are_spread_where_the_file_system_can(tmp_path: Path) -> None:
    """The run's scratch directory gets ext4's ``T`` attribute (what ``lsattr`` shows), so each
    round's directory is placed apart from the one the round before removed; on a file system
    without it (tmpfs) nothing changes and the call says so, and the report tells which."""
    import shutil
    import subprocess
    import tempfile

    from gdskv.bench import BenchOptions, format_report, run, spread_directories

    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    took = spread_directories(tmp_path)
    if fs == "ext2/ext3":
        assert took
    if shutil.which("lsattr"):
        shown = subprocess.run(["lsattr", "-d", str(tmp_path)], capture_output=True, text=True)
        if shown.returncode == 0:
            assert ("T" in shown.stdout.split()[0]) == took
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        plain = Path(tempfile.mkdtemp(dir=shm))
        try:
            assert spread_directories(plain) is False
        finally:
            plain.rmdir()
    report = run(BenchOptions(directory=str(tmp_path), total_bytes=128 << 10, page_sizes=(64 << 10,), rounds=1,
                              engines=("posix+o_direct",), peers=(), baselines=False, service=False))
    assert report["spread_directories"] is took
    assert ("round directories: not spread" in format_report(report)) is not took


def test_the_peer_driver_loop_answers_each_command_and_reports_failures(tmp_path: Path) -> None:
    """The drivers' command loop, in a real process: ready, one answer per command, an error
    answer (not a dead process) when a command fails."""
    import json
    import subprocess
    import sys

    import gdskv.peers

    script = tmp_path / "toy_driver.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(gdskv.peers.__file__).parent)!r})\n"
        "from driver_loop import serve\n"
        "class Toy:\n"
        "    def add(self, a, b): return {'sum': a + b}\n"
        "    def fail(self): raise OSError('disk gone')\n"
        "serve(Toy, 'toy')\n")
    cmds = [{"op": "add", "a": 2, "b": 3}, {"op": "fail"}, {"op": "add", "a": 1, "b": 1}, {"op": "quit"}]
    out = subprocess.run([sys.executable, str(script)], input="".join(json.dumps(c) + "\n" for c in cmds),
                         capture_output=True, text=True, timeout=60).stdout.splitlines()
    answers = [json.loads(line) for line in out]
    assert answers[0] == {"ready": True}
    assert answers[1] == {"ok": True, "sum": 5}
    assert "disk gone" in answers[2]["error"]
    assert answers[3] == {"ok": True, "sum": 2}


class _OneFile(Subject):
    """Pages in one real file; ``warm_reads`` False: a warm load that moves nothing (a bug the
    bench must catch, since the target was cleared before it)."""

    name = "one-file"
    pool = "torch"

    def __init__(self, warm_reads: bool) -> None:
        self.warm_reads, self.calls, self.loads = warm_reads, [], 0

    def save(self, pages: torch.Tensor) -> None:
        (self.workdir / "pages").write_bytes(pages.numpy().tobytes())

    def load(self, pages: torch.Tensor) -> None:
        self.calls.append("load")
        self.loads += 1
        if self.loads == 1 or self.warm_reads:
            data = (self.workdir / "pages").read_bytes()
            pages.view(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def clear(self, target: torch.Tensor) -> None:
        self.calls.append("clear")
        super().clear(target)

    def check(self, source: torch.Tensor, target: torch.Tensor) -> None:
        self.calls.append("check")
        super().check(source, target)

    def files(self) -> list[str]:
        return [str(self.workdir / "pages")]


def test_every_timed_load_goes_into_cleared_pages_and_is_checked_after(tmp_path: Path) -> None:
    source = torch.randint(0, 256, (8, 4096), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    good = _OneFile(warm_reads=True)
    secs = measure(good, source, torch.empty_like(source), tmp_path)
    assert set(secs) == {"save", "load_cold", "load_warm"}
    assert good.calls == ["clear", "load", "check"] * 2
    with pytest.raises(RuntimeError, match="differ"):
        measure(_OneFile(warm_reads=False), source, source.clone(), tmp_path)


def test_the_files_baseline_reads_back_what_it_wrote_one_file_per_page(tmp_path: Path) -> None:
    source = torch.randint(0, 256, (70, 4096), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    files = FilePerPage(threads=4)
    try:
        secs = measure(files, source, torch.empty_like(source), tmp_path)  # measure checks every load
        assert set(secs) == {"save", "load_cold", "load_warm"} and len(set(files.files())) == 70
    finally:
        files.close()


def test_a_peer_whose_driver_dies_is_left_out_and_the_run_goes_on(tmp_path: Path, monkeypatch) -> None:
    """A peer's driver killed mid-run (out of memory, a crash): the bench reports why (exit
    status, its last stderr line) and the other subjects' figures, instead of a broken pipe."""
    import os
    import sys

    import gdskv.peers
    from gdskv.bench import BenchOptions, format_report, run

    cache = tmp_path / "cache"
    (cache / "gdskv-test" / "venv-toy" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, cache / "gdskv-test" / "venv-toy" / "bin" / "python")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    script = tmp_path / "dying_driver.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(gdskv.peers.__file__).parent)!r})\n"
        "from driver_loop import serve\n"
        "class Dying:\n"
        "    def prepare(self, dir, **kw): self.dir = dir; return {}\n"
        "    def save(self): open(os.path.join(self.dir, 'f'), 'wb').write(b'x'); return {}\n"
        "    def files(self): return {'files': [os.path.join(self.dir, 'f')]}\n"
        "    def clear(self): return {}\n"
        "    def load(self): print('killed: out of memory', file=sys.stderr, flush=True); os._exit(9)\n"
        "    def end_round(self): return {}\n"
        "serve(Dying, 'dying')\n")
    monkeypatch.setitem(gdskv.peers.PEERS, "toy", gdskv.peers.Peer("toy", str(script), "venv-toy", "import json", None))
    report = run(BenchOptions(directory=str(tmp_path), total_bytes=256 << 10, page_sizes=(64 << 10, 128 << 10), rounds=2,
                              engines=("posix+o_direct",), peers=("toy",), baselines=False, service=False))
    [why] = [v for k, v in report["skipped"].items() if k.startswith("peer:toy")]
    assert "status 9" in why and "out of memory" in why
    assert {(r["subject"], r["page_bytes"]) for r in report["results"]} == {
        ("store:posix+o_direct@torch", 64 << 10), ("store:posix+o_direct@torch", 128 << 10)}
    assert "out of memory" in format_report(report)


def test_the_service_subject_reads_cold_and_warm_from_disk_and_hot_from_the_host_tier(tmp_path: Path, monkeypatch) -> None:
    """``ServiceSubject`` through a real ``KvService``: the cold and warm loads read every page from
    the disk (the tier forgot them), the hot one from the tier (checked by its counters inside
    ``load_hot``), each into cleared pages checked after; the report carries hot/cold."""
    from gdskv.bench import BenchOptions, ServiceSubject, format_report, run

    subject = ServiceSubject(BenchOptions(), "torch")
    source = torch.randint(0, 256, (16, 8192), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    reads: list[int] = []
    real_end = ServiceSubject.end_round

    def end_round(self) -> None:
        reads.append(self.svc.namespace.counters["loads_hit"])
        real_end(self)

    monkeypatch.setattr(ServiceSubject, "end_round", end_round)
    secs = measure(subject, source, torch.empty_like(source), tmp_path)
    assert set(secs) == {"save", "load_cold", "load_warm", "load_hot"}
    assert reads == [32]  # 16 cold + 16 warm pages from the disk, none of the hot ones
    report = run(BenchOptions(directory=str(tmp_path), total_bytes=256 << 10, page_sizes=(64 << 10,), rounds=1,
                              engines=(), peers=(), baselines=False))
    [row] = report["results"]
    assert row["subject"] == "service:host-tier@torch" and row["hot_vs_cold"] > 0
    assert "hot/cold" in format_report(report)


def test_where_the_page_cache_serves_cold_loads_the_hot_figure_is_left_out_with_the_reason() -> None:
    """On tmpfs the files cannot be dropped from memory, so the service's "cold" load is served by
    the page cache and leaves the host tier alone: the run goes on without a hot figure and says
    why, where it used to stop with "the hot load was not served from the host tier"."""
    import shutil
    import tempfile

    from gdskv.bench import BenchOptions, format_report, run

    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) here")
    where = tempfile.mkdtemp(dir=shm)
    try:
        report = run(BenchOptions(directory=where, total_bytes=256 << 10, page_sizes=(64 << 10,), rounds=2,
                                  engines=(), peers=(), baselines=False))
    finally:
        shutil.rmtree(where)
    [row] = report["results"]
    assert row["subject"] == "service:host-tier@torch" and "load_hot_gbps" not in row and "hot_vs_cold" not in row
    [why] = [v for k, v in report["skipped"].items() if k.startswith("service:host-tier@torch hot loads")]
    assert "page cache" in why
    assert "hot loads at 64K pages left out" in format_report(report)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _busy_peer_bench(tmp_path: Path):
    """A real bench process (``gdskv.bench.run``) measuring only a toy peer whose driver is
    stuck in its save (the bench waiting on it), started once the driver wrote its pid; the
    process, the driver's pid and the bench's directory."""
    import json
    import os
    import subprocess
    import sys
    import time

    import gdskv.peers

    cache, work = tmp_path / "cache", tmp_path / "work"
    (cache / "gdskv-test" / "venv-toy" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, cache / "gdskv-test" / "venv-toy" / "bin" / "python")
    work.mkdir()
    pidfile = tmp_path / "driver.pid"
    driver = tmp_path / "busy_driver.py"
    driver.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(gdskv.peers.__file__).parent)!r})\n"
        "from driver_loop import serve\n"
        "class Busy:\n"
        "    def prepare(self, dir, **kw): return {}\n"
        f"    def save(self): open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600); return {{}}\n"
        "serve(Busy, 'busy')\n")
    runner = tmp_path / "runner.py"
    runner.write_text(
        "import gdskv.peers\n"
        "from gdskv.bench import BenchOptions, run\n"
        f"gdskv.peers.PEERS['toy'] = gdskv.peers.Peer('toy', {str(driver)!r}, 'venv-toy', 'import json', None)\n"
        f"run(BenchOptions(directory={str(work)!r}, total_bytes=64 << 10, page_sizes=(64 << 10,), rounds=1, engines=(),\n"
        "                 peers=('toy',), baselines=False, service=False))\n")
    bench = subprocess.Popen([sys.executable, str(runner)], env={**os.environ, "XDG_CACHE_HOME": str(cache)},
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (pidfile.exists() and pidfile.read_text()):
        assert bench.poll() is None, f"the bench ended early: {bench.stderr.read() if bench.stderr else ''}"
        assert time.monotonic() < deadline, "the toy driver never started saving"
        time.sleep(0.05)
    assert [p.name.startswith("gdskv-bench-") for p in work.iterdir()] == [True]
    return bench, json.loads(pidfile.read_text()), work


def test_a_terminated_bench_stops_its_peer_drivers_and_removes_its_files(tmp_path: Path) -> None:
    """SIGTERM (``timeout``, a job manager) while a peer's driver is busy: the bench kills the
    driver, removes its temporary directory and exits 143, without a traceback."""
    import signal

    bench, driver, work = _busy_peer_bench(tmp_path)
    bench.send_signal(signal.SIGTERM)
    _, err = bench.communicate(timeout=60)
    assert bench.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert not _running(driver)
    assert list(work.iterdir()) == []


def test_a_peer_driver_whose_bench_is_killed_exits_by_itself(tmp_path: Path) -> None:
    """SIGKILL of the bench (nothing of it runs after): its busy peer driver notices it is
    orphaned and exits within seconds instead of going on for minutes."""
    import signal
    import time

    bench, driver, _ = _busy_peer_bench(tmp_path)
    bench.send_signal(signal.SIGKILL)
    bench.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while _running(driver) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(driver)


def test_a_row_meets_its_target_only_when_every_ratio_of_the_issue_does() -> None:
    from gdskv.bench import add_ratios

    def row(subject: str, save: float, cold: float, warm: float, hot: float = 0.0) -> dict:
        return {"page_bytes": 1 << 20, "subject": subject, "save_gbps": save, "load_cold_gbps": cold,
                "load_warm_gbps": warm, **({"load_hot_gbps": hot} if hot else {})}

    base = [row("ceiling", 3.0, 2.0, 2.0), row("raw", 2.0, 2.0, 10.0), row("files", 1.0, 1.5, 8.0),
            row("peer:vllm-fs-tier", 1.0, 1.75, 2.0)]
    cases = {"store:ok": (row("store:ok", 1.8, 1.95, 8.0), True),
             "service:ok": (row("service:ok", 1.8, 1.95, 8.0, 10.0), True),
             "store:slow-save": (row("store:slow-save", 1.6, 1.95, 8.0), False),
             "store:slow-cold": (row("store:slow-cold", 1.8, 1.7, 8.0), False),
             "store:below-vllm": (row("store:below-vllm", 1.8, 1.85, 8.0), False),
             "store:slow-warm": (row("store:slow-warm", 1.8, 1.95, 7.9), False),
             "service:cool-tier": (row("service:cool-tier", 1.8, 1.95, 8.0, 9.7), False)}
    report = {"results": base + [r for r, _ in cases.values()]}
    add_ratios(report, 1 << 20)
    assert {name: r["meets_target"] for name, (r, _) in cases.items()} == {n: want for n, (_, want) in cases.items()}
