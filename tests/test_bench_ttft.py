"""``scripts/bench_ttft.py`` at a toy size, in a subprocess: every section runs end to end (served
runs must match the computed run bit for bit, or the script fails), the report has its tables, the
JSON its figures, and a bad argument is one line with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_ttft.py"
TOY = ["--lengths", "64", "--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
       "--decode", "4", "--decode-prompt", "40", "--decode-batch", "2", "--page-sizes", "64K", "--load-bytes", "1M",
       "--rounds", "1"]
SECTIONS = ["--only", "ttft", "--only", "decode", "--only", "loads"]  # MAX's: tests/test_max_integration.py


@pytest.mark.slow
def test_a_toy_run_reports_every_section(tmp_path):
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--json", str(out), *TOY, *SECTIONS],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    for heading in ("TTFT (s)", "decode step (ms", "page loads through KvService"):
        assert heading in run.stdout
    figures = json.loads(out.read_text())
    [ttft] = figures["ttft"]
    assert ttft["tokens"] == 64 and ttft["host_hits_so_far"] > 0
    assert all(ttft[k] > 0 for k in ("computed", "served cold", "served warm", "served cold+fill", "served hot"))
    without, paced, flat_out = figures["decode"]
    assert without["saves"] == "none" and without["ratio"] == 1.0 and without["steps"] >= 2
    assert paced["steps"] >= 2 and flat_out["steps"] >= 2 and flat_out["saved_mb_per_s"] > 0
    assert without["round_ratios"] == [1.0] and len(flat_out["round_ratios"]) == 1  # one rotation, paired
    assert flat_out["ratio"] == flat_out["round_ratios"][0] > 0
    [loads] = figures["loads"]
    assert loads["pages"] == 16 and loads["hot_gbps"] > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gdskv-bench-ttft-")], "work directory left behind"


def test_a_bad_length_is_one_line():
    run = subprocess.run([sys.executable, str(SCRIPT), "--lengths", "lots"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and "--lengths" in run.stderr


def test_a_bad_option_is_one_line_not_a_usage_block():
    run = subprocess.run([sys.executable, str(SCRIPT), "--only", "bogus"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("bench_ttft: argument --only")


def test_the_max_section_without_a_max_virtualenv_is_skipped_with_the_reason(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--only", "max", "--max-python",
                          str(tmp_path / "no-venv" / "bin" / "python"), "--json", str(tmp_path / "f.json")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "MAX: skipped (no MAX virtualenv at" in run.stdout
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["max"] == [] and "no MAX virtualenv" in figures["max_skipped"]


def test_the_saver_keeps_only_its_last_chunks_on_disk(tmp_path):
    """The decode section's saver, saving as fast as it goes, removes its older chunks beyond
    ``keep_bytes`` (a round at disk speed once filled the disk): more pages published than kept."""
    import time

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_ttft
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from gdskv.config import GdsKvConfig
    from gdskv.service import KvService
    from gdskv.store import GroupSpec, NamespaceSpec

    page = 64 << 10
    svc = KvService(GdsKvConfig(store_path=str(tmp_path / "store"), host_bytes=0),
                    NamespaceSpec(model="saver", dtype="uint8", tokens_per_block=1, groups=(GroupSpec(0, page, (0,)),)))
    saver = bench_ttft.Saver(svc, depth=4, rate=0, keep_bytes=4 * page)
    saver.start()
    deadline = time.monotonic() + 30
    while saver.published < 40 and time.monotonic() < deadline:  # a serving loop's steps
        svc.reap()
        saver.tick()
        time.sleep(0.002)
    saver.stop()
    chunks = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.name.isdigit()]
    assert saver.published >= 40 and len(chunks) == 4
    svc.close()
