"""``scripts/gpu_check.py`` on a machine without a GPU: it refuses in one line, and its pure parts
(arguments, the file-system probe, the table, the pass/fail decision) are right."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gdskv_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gc = _load()
R = gc.Result


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run its checks")
def test_without_cuda_it_refuses_in_one_line(tmp_path: Path) -> None:
    done = _run("--dir", str(tmp_path))
    assert done.returncode == gc.EXIT_REFUSED != 0
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: refused: no CUDA device"), done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing made before the refusal


def test_dir_is_required() -> None:
    done = _run()
    assert done.returncode == 2 and "--dir" in done.stderr and "Traceback" not in done.stderr


MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
25 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs devtmpfs rw
26 25 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
40 22 259:3 / /mnt/nvme rw,relatime shared:20 - xfs /dev/nvme1n1 rw
41 40 0:50 / /mnt/nvme/over rw,relatime shared:21 - overlay overlay rw,lowerdir=/a,upperdir=/b
42 22 0:51 / /mnt/with\\040space rw shared:22 - btrfs /dev/sdb rw
"""


@pytest.mark.parametrize("path, fs", [
    ("/", "ext4"), ("/home/u/x", "ext4"), ("/dev/shm", "tmpfs"), ("/dev/shm/a/b", "tmpfs"),
    ("/dev/shmx", "devtmpfs"), ("/mnt/nvme", "xfs"), ("/mnt/nvme/kv", "xfs"), ("/mnt/nvme/over/kv", "overlay"),
    ("/mnt/with space/d", "btrfs"),
])
def test_mount_fs_type_takes_the_longest_mount_point(path: str, fs: str) -> None:
    assert gc.mount_fs_type(MOUNTINFO, path) == fs


def test_mount_fs_type_of_this_machine_is_a_name() -> None:
    text = Path("/proc/self/mountinfo").read_text()
    assert isinstance(gc.mount_fs_type(text, str(ROOT)), str)
    assert gc.mount_fs_type("", "/x") is None


def test_refusals_name_their_reason() -> None:
    assert "no CUDA" in gc.refusal(False, "/d", True, "ext4")
    assert "not a directory" in gc.refusal(True, "/nope", False, None)
    for fs in ("tmpfs", "overlay", "ramfs"):
        assert fs in gc.refusal(True, "/d", True, fs)
    for fs in ("ext4", "xfs", "btrfs", "nfs4", None):
        assert gc.refusal(True, "/d", True, fs) is None


def test_verdict_passes_only_when_every_check_passed() -> None:
    ok = [R("a", gc.PASS), R("b", gc.PASS, "x")]
    assert gc.verdict(ok)[0] == gc.EXIT_PASSED
    assert gc.verdict(ok + [R("second device", gc.SKIP, "one device")])[0] == gc.EXIT_PASSED
    code, line = gc.verdict(ok + [R("c", gc.FAIL, "boom")])
    assert code == gc.EXIT_FAILED and "FAILED: c" in line
    code, line = gc.verdict(ok + [R("save race control", gc.INCONCLUSIVE)])
    assert code == gc.EXIT_FAILED and "INCONCLUSIVE: save race control" in line
    assert gc.verdict([R("a", gc.SKIP)])[0] == gc.EXIT_FAILED
    assert gc.verdict([])[0] == gc.EXIT_FAILED
    assert gc.verdict(ok, dry_run=True)[0] == gc.EXIT_DRY_RUN != 0


def test_a_race_control_without_a_race_is_inconclusive() -> None:
    rows = gc.race_result("save", with_event_ok=True, control_showed_race=True)
    assert [r.status for r in rows] == [gc.PASS, gc.PASS]
    rows = gc.race_result("save", with_event_ok=True, control_showed_race=False)
    assert [r.status for r in rows] == [gc.PASS, gc.INCONCLUSIVE] and gc.verdict(rows)[0] != 0
    rows = gc.race_result("load", with_event_ok=False, control_showed_race=True)
    assert rows[0].status == gc.FAIL and gc.verdict(rows)[0] != 0


def test_gds_row_from_backend_bytes() -> None:
    assert gc.gds_result(True, 10, 0, require_gds=True).status == gc.PASS
    assert gc.gds_result(True, 0, 10, require_gds=False).status == gc.FAIL  # GDS offered, never used
    assert gc.gds_result(False, 0, 10, require_gds=False).status == gc.SKIP
    assert gc.gds_result(False, 0, 10, require_gds=True).status == gc.FAIL


def test_table_has_one_line_per_result() -> None:
    rows = [R("platform", gc.PASS, "H200"), R("a much longer check name", gc.INCONCLUSIVE, "why"), R("x", gc.SKIP)]
    lines = gc.format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].startswith("check") and "status" in lines[0]
    assert lines[3].startswith("a much longer check name  INCONCLUSIVE") and lines[3].endswith("why")
    assert lines[2].index(gc.PASS) == lines[3].index("INCONCLUSIVE") == lines[4].index(gc.SKIP)  # aligned


def test_dry_run_on_host_memory_never_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``--device cpu``: the host-memory checks run (kvikio through the driver double) and pass,
    and still the exit status is not 0."""
    pytest.importorskip("kvikio", reason="kvikio is an optional extra (gdskv[cu12])")
    try:
        from tests.fakecuda import ensure_libcuda
    except ImportError:
        from fakecuda import ensure_libcuda
    ensure_libcuda()
    monkeypatch.delenv("GDSKV_STORE", raising=False)
    try:
        code = gc.main(["--dir", str(tmp_path), "--device", "cpu"])
    finally:
        from gdskv.io.kvikio_engine import KvikioEngine

        KvikioEngine(threads=4, task_size=1 << 20).close()  # the settings test_io_engines expects
    out = capsys.readouterr().out
    assert code == gc.EXIT_DRY_RUN, out
    for row in ("kvikio round trips", "concurrent saves", "device checksum", "TensorRT-LLM worker", "MAX connector",
                "host tier"):
        assert any(line.startswith(row) and f" {gc.PASS} " in line for line in out.splitlines()), (row, out)
    assert "GDSKV_STORE" not in __import__("os").environ
    assert list(tmp_path.iterdir()) == []
