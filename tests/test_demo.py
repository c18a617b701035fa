"""``gdskv demo`` end to end, as a user runs it: a subprocess on a fresh store."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def test_demo_round_trips_and_serves_the_prefix(tmp_path):
    """Its stdout is a pipe, as in a log or CI: no line may wrap inside a figure (issue 15)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["GDSKV_STORE"] = str(tmp_path / "store")
    out = subprocess.run([sys.executable, "-m", "gdskv.cli.main", "demo", "--pages-per-prompt", "4", "--page-bytes", "65536", "--system-tokens", "96"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert re.search(r"save: 10 pages of 0.0625 MiB: 10 saved", text)
    assert re.search(r"load: 10 pages of 0.0625 MiB: 10 loaded and verified, 0 missed", text)
    assert "engine: posix" in text or "engine: kvikio" in text
    assert re.search(r"run 1: .*served from the store \[0, 0\]", text)
    assert re.search(r"run 2: .*served from the store \[128, 128\]", text)
    assert "outputs identical" in text and "OK:" in text
    for phase in ("save", "load"):  # each phase's figures on one line, however long
        assert re.search(rf"^   {phase}: .* MiB in \d+ ms = \d+\.\d\d GB/s  engine: \S+", text, re.M), text
    assert "\x1b[" not in text


def _demo_with_config(tmp_path, toml: str) -> subprocess.CompletedProcess:
    config = tmp_path / "gdskv.toml"
    config.write_text(toml)
    env = dict(os.environ, GDSKV_STORE=str(tmp_path / "store"), GDSKV_CONFIG=str(config))
    return subprocess.run([sys.executable, "-m", "gdskv.cli.main", "demo", "--pages-per-prompt", "4", "--page-bytes", "65536",
                           "--system-tokens", "96"], capture_output=True, text=True, env=env, timeout=300)


def test_demo_under_a_byte_budget_smaller_than_its_pages_says_so_and_passes(tmp_path):
    """Pages the budget refused or evicted are the budget at work, not a fault: the demo names the
    limit and checks every page the store kept."""
    out = _demo_with_config(tmp_path, '[gdskv]\nmax_bytes = "400K"\n')
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"capacity limits \(max_bytes 400\.0 KiB\) refused or evicted \d+ of 10 pages; "
                     r"the demo's pages need 640\.0 KiB", out.stdout), out.stdout
    assert re.search(r"load: 10 pages of 0.0625 MiB: [1-9] loaded and verified", out.stdout), out.stdout
    assert "OK:" in out.stdout and "FAILED" not in out.stdout


def test_demo_under_a_budget_that_keeps_no_page_fails_in_one_line(tmp_path):
    out = _demo_with_config(tmp_path, '[gdskv]\nmax_bytes = "32K"\n')
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no page kept, nothing to check: the store's capacity limits (max_bytes 32.0 KiB)" in out.stdout
    assert "FAILED" in out.stdout and "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize("args", [["--page-bytes", "-5"], ["--pages-per-prompt", "0"], ["--system-tokens", "8"]])
def test_a_bad_demo_option_is_a_one_line_usage_error(tmp_path, args):
    env = dict(os.environ, GDSKV_STORE=str(tmp_path / "store"))
    out = subprocess.run([sys.executable, "-m", "gdskv.cli.main", "demo", *args], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr and "Invalid value for" in out.stderr
    assert not (tmp_path / "store").exists()
