"""The adversarial harness (``scripts/torture.py``) in its fast variant: every scenario must
count zero wrong loads, exceptions to the caller, lost published or leased chunks, files touched
outside the store, hangs and other violations.

The whole fast run happens once, in a fresh process (it forks, SIGKILLs and mounts), and each
scenario is then its own test. Scenarios that need to mount a file system are skipped where
mounting is not allowed, with the harness's reason.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "torture.py"


def _harness():
    """scripts/torture.py as a module (registered first: its dataclasses need that)."""
    if "gdskv_torture" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gdskv_torture", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gdskv_torture"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["gdskv_torture"]


SCENARIOS = list(_harness().SCENARIOS)
COUNTS = ("wrong_loads", "exceptions", "lost", "outside", "hangs", "other")


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("torture")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKV_")}  # runs before the per-test isolation
    proc = subprocess.run([sys.executable, str(SCRIPT), "--fast", "--json", "--dir", str(work)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"torture.py --fast --json printed no JSON (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_counts_nothing(fast_run: dict, scenario: str) -> None:
    rows = [r for r in fast_run["rows"] if r["scenario"] == scenario]
    assert rows, f"the fast run has no row for {scenario}"
    live = [r for r in rows if not r["skipped"]]
    if not live:
        pytest.skip(f"{scenario}: {rows[0]['skipped']}")
    problems = []
    for r in live:
        counts = {f: r[f] for f in COUNTS if r[f]}
        if counts:
            problems.append(f"[{r['checksum']}] {counts}\n    " + "\n    ".join(r["details"]))
        elif not r["trials"]:
            problems.append(f"[{r['checksum']}] ran no trials")
    assert not problems, f"{scenario}:\n" + "\n".join(problems)


def test_table_columns_and_failure_flag() -> None:
    """The table prints every column, and any count marks the row failed (exit status 1)."""
    mod = _harness()
    ok, bad = mod.Row("a"), mod.Row("b", trials=3)
    bad.add("wrong", "x")
    text = mod.format_table([ok, bad])
    for col in ("wrong loads", "exceptions", "lost published/leased", "outside store", "hangs", "seconds"):
        assert col in text
    assert not ok.failed and bad.failed
