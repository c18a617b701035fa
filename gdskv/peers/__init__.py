"""Peers as benchmark subjects: what users would run instead of gdskv, measured in the same run.

``gdskv.bench`` builds one ``PeerSubject`` per peer. Each runs a driver script of this package
(``vllm_fs_driver.py``, ``lmcache_disk_driver.py``) with the python of the peer's own virtualenv,
under the user's cache directory (``~/.cache/gdskv-test``): vLLM's is the one the vLLM integration
test makes (never installed into here), LMCache's is made here on first use (``lmcache==0.5.6``
and torch, from the package index) and reused. A peer whose virtualenv cannot be had or whose
driver cannot start is left out with the reason, which the report prints. The drivers never
import gdskv; they speak JSON lines over stdin/stdout, one answer per command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
TORCH_REQUIREMENT = "torch==2.13.0"


class PeerUnavailable(RuntimeError):
    """The peer cannot be measured here; the message says why (printed by the bench)."""


def venv_root() -> Path:
    """Where the peers' virtualenvs live: ``$XDG_CACHE_HOME/gdskv-test`` (``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gdskv-test"


@dataclass(frozen=True)
class Peer:
    """One peer: its label, driver script, virtualenv, the import that proves the virtualenv
    usable, and the requirement that makes it (None: this bench never installs it)."""

    name: str
    driver: str
    venv: str
    probe: str
    requirement: Optional[str]

    def python(self, log=lambda line: None) -> Path:
        """The virtualenv's python, made when missing and this bench may make it; else
        ``PeerUnavailable``."""
        path = venv_root() / self.venv
        py = path / "bin" / "python"
        if _probe(py, self.probe):
            return py
        if self.requirement is None:
            raise PeerUnavailable(f"no usable virtualenv at {path} (made by tests/test_vllm_integration.py; "
                                  f"this bench does not install into it)")
        log(f"making {path} for {self.name} ({self.requirement}); this takes minutes once")
        try:
            subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", self.requirement, TORCH_REQUIREMENT],
                           check=True, capture_output=True, timeout=1800)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            raise PeerUnavailable(f"cannot make {path}: {exc} {detail.decode(errors='replace')[-300:]}") from exc
        if not _probe(py, self.probe):
            raise PeerUnavailable(f"{path} was made but `{self.probe}` fails there")
        return py


PEERS = {
    "vllm": Peer("vllm-fs-tier", "vllm_fs_driver.py", "venv-vllm", "import vllm.v1.kv_offload.tiering.fs.manager", None),
    "lmcache": Peer("lmcache-disk", "lmcache_disk_driver.py", "venv-lmcache", "import lmcache.v1.cache_engine",
                    "lmcache==0.5.6"),
}


def _probe(py: Path, code: str) -> bool:
    if not py.exists():
        return False
    try:
        return subprocess.run([str(py), "-c", code], capture_output=True, cwd="/", timeout=300).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class PeerSubject:
    """A peer as a ``gdskv.bench`` subject: same calls as the bench's own subjects (``prepare``,
    ``save``, ``load``, ``files``, ``end_round``, ``close``), carried out by the driver process,
    which holds its own page pool (the same page count and size, random pages from the round's
    seed): ``clear`` and ``check`` are its driver's, on that pool."""

    supports_hot = False
    pool = "own"  # the driver allocates its own pool

    def __init__(self, key: str, log=lambda line: None, **prepare_extra: Any):
        peer = PEERS[key]
        self.name = f"peer:{peer.name}"
        self._extra = prepare_extra
        py = peer.python(log)
        self._busy = False
        """A command was sent and its answer not read (set while ``_call`` waits): on ``close``
        the driver is still working on it, or the wait was interrupted, and it is killed."""
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([str(py), str(HERE / peer.driver)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True, cwd="/")
        hello = self._read()
        if "error" in hello:
            self.close()
            raise PeerUnavailable(hello["error"])

    def _read(self) -> dict:
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line:
            raise self._gone()
        return json.loads(line)

    def _gone(self) -> PeerUnavailable:
        """The driver died: its exit status and the last line it wrote to stderr."""
        try:
            status = self._proc.wait(5)
        except subprocess.TimeoutExpired:
            status = None
        self._stderr.seek(0)
        last = [ln for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()][-1:]
        return PeerUnavailable(f"{self.name}: the driver exited (status {status}){': ' + last[0] if last else ''}")

    def _call(self, op: str, **args: Any) -> dict:
        assert self._proc.stdin is not None
        self._busy = True
        try:
            self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self._proc.stdin.flush()
        except OSError:  # a broken pipe: the driver is gone
            raise self._gone() from None
        answer = self._read()
        self._busy = False
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return answer

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        self.workdir = workdir
        self._call("prepare", dir=str(workdir), pages=num_pages, page_bytes=page_bytes, seed=page_bytes, **self._extra)

    def save(self, pages: Any) -> None:
        self._call("save")

    def load(self, pages: Any) -> None:
        self._call("load")

    def clear(self, target: Any) -> None:
        self._call("clear")

    def check(self, source: Any, target: Any) -> None:
        self._call("check")

    def files(self) -> list[str]:
        return self._call("files")["files"]

    def end_round(self) -> None:
        if not self._busy:  # else the round was interrupted mid-command: ``close`` kills the driver
            self._call("end_round")

    def close(self) -> None:
        """Ask the driver to quit and wait for it; kill it when it is still busy with a command
        (the bench was interrupted or terminated meanwhile) or does not quit."""
        if self._proc.poll() is None and self._busy:
            self._proc.kill()
            self._proc.wait()
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._proc.stdin.close()
                self._proc.wait(30)
            except (OSError, subprocess.SubprocessError):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()
