"""``scripts/bench_decode_under_load.py`` at a toy size, in a subprocess: every mode runs end to
end on a real store (the restored request's prefix served from it; ``hot`` from the worker's host
tier), pinned or not, and a bad
argument is one line with exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_decode_under_load.py"
TOY = ["--prefix", "256", "--decoders", "2", "--steps", "24", "--arrive", "4", "--rounds", "1", "--json"]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
def test_a_toy_run_restores_the_prefix_in_every_mode(tmp_path, pin):
    if pin and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--pin-engine needs two CPUs")
    got = run(*TOY, "--dir", str(tmp_path), *(["--pin-engine"] if pin else []), cwd=ROOT)
    assert got.returncode == 0, got.stderr[-2000:]
    report = json.loads(got.stdout)
    by_mode = {r["mode"]: r for r in report["rows"]}
    assert report["pinned"] is pin and set(by_mode) == {"none", "async", "hot", "sync"}
    for mode in ("async", "hot", "sync"):  # the whole stored prefix served, from the store
        assert by_mode[mode]["loaded"] == 256 and by_mode[mode]["bytes"] > 0
    assert by_mode["hot"]["host_hits"] == 256 // 64 and by_mode["async"]["host_hits"] == 0  # hot: from host memory
    assert by_mode["async"]["window_steps"] >= 1 and by_mode["hot"]["window_steps"] >= 1 and by_mode["none"]["loaded"] == 0
    if sys.platform.startswith("linux"):  # the hypervisor's share of the CPU time, as /proc/stat counts it
        assert all(0.0 <= r["steal_pct"] <= 100.0 for r in report["rows"])


def test_a_bad_round_count_is_one_line(tmp_path):
    got = run("--rounds", "0", cwd=tmp_path)
    assert got.returncode == 2 and got.stderr.strip() == "bench_decode_under_load: --rounds must be at least 1"


@pytest.mark.parametrize("args", [("--prefix", "4k"), ("--prefix", "0"), ("--rounds", "x")])
def test_a_bad_argument_is_one_line_not_a_traceback_or_usage_block(tmp_path, args):
    got = run(*args, cwd=tmp_path)
    assert got.returncode == 2 and got.stdout == "" and got.stderr.count("\n") == 1, got.stderr
    assert got.stderr.startswith(f"bench_decode_under_load: argument {args[0]}"), got.stderr
