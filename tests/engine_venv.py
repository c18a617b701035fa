"""The virtualenv an integration test runs a real engine in (MAX, vLLM), under the user's cache
directory, made once per machine and reused while it fits.

``EngineVenv.ensure()`` makes the virtualenv when missing, installs the engine with gdskv's own
dependencies (read from ``pyproject.toml``, torch pinned to the README's release) when the
engine's probe fails, and installs this checkout of gdskv (``pip install --no-deps -e``) when the
virtualenv's ``gdskv`` is another checkout's: a virtualenv that already fits costs two probes.
The virtualenv is self-contained (no ``--system-site-packages``: made from inside another
virtualenv that exposes the base interpreter's packages, not that virtualenv's). Called by the
session fixtures of tests/test_max_integration.py and tests/test_vllm_integration.py.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
TORCH_REQUIREMENT = "torch==2.13.0"


def gdskv_requirements() -> list[str]:
    """gdskv's runtime dependencies as ``pyproject.toml`` lists them, torch pinned."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [TORCH_REQUIREMENT] + [d for d in deps if not d.replace(" ", "").startswith("torch")]


@dataclass
class EngineVenv:
    """``path``: the virtualenv; ``requirement``: the engine (``max[serve]==...``);
    ``engine_probe``: Python code that imports what the test needs of the engine;
    ``connector_module``: gdskv's adapter for it; ``env``: the environment probes run with;
    ``after_install``: pip arguments run after the engine install (e.g. an uninstall)."""

    path: Path
    requirement: str
    engine_probe: str
    connector_module: str
    env: Callable[[], dict[str, str]]
    after_install: list[list[str]] = field(default_factory=list)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def _probe(self, code: str) -> bool:
        return self.python.exists() and subprocess.run([str(self.python), "-c", code], capture_output=True,
                                                       env=self.env(), cwd="/").returncode == 0

    def engine_ready(self) -> bool:
        """The engine imports and every runtime dependency in ``pyproject.toml`` is installed
        (a dependency added since the virtualenv was made gets installed, not missed)."""
        names = [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] for d in gdskv_requirements()]
        deps = f"import importlib.metadata as m; [m.version(n) for n in {names!r}]"
        return self._probe(f"{self.engine_probe}; {deps}")

    def gdskv_ready(self) -> bool:
        return self._probe(f"import gdskv, gdskv.cli.main, {self.connector_module}; "
                           f"assert gdskv.__file__ == {str(REPO / 'gdskv' / '__init__.py')!r}")

    def ensure(self) -> Path:
        """The virtualenv's interpreter, with the engine, gdskv's dependencies and this checkout."""
        pip = [str(self.python), "-m", "pip", "install", "-q"]
        if not self.engine_ready():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.python.exists():
                subprocess.run([sys.executable, "-m", "venv", "--clear", str(self.path)], check=True)
            subprocess.run(pip + ["--upgrade", "pip", "setuptools"], check=True)  # pip 23's resolver gives up on max[serve]
            subprocess.run(pip + [self.requirement] + gdskv_requirements(), check=True)
            for args in self.after_install:
                subprocess.run([str(self.python), "-m", "pip", *args], check=True)
            assert self.engine_ready(), f"{self.path} still cannot import {self.requirement} and gdskv's dependencies"
        if not self.gdskv_ready():
            subprocess.run(pip + ["--no-deps", "-e", str(REPO)], check=True)
            assert self.gdskv_ready(), f"{self.path} does not import gdskv from {REPO} after installing it"
        return self.python
