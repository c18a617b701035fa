"""Test double of the CUDA driver, so the kvikio engine runs in CI without a GPU. Tests only.

``fake_libcuda.c`` exports the driver symbols kvikio resolves; every call fails with
CUDA_ERROR_NOT_INITIALIZED, so kvikio treats all memory as host memory and moves it through its
POSIX thread pool (compat mode). ``ensure_libcuda()`` is called by the kvikio tests' fixture (and by
the subprocess they start) before the first kvikio I/O of the process: it leaves a real
``libcuda.so.1`` alone and only builds and loads the double where none can be opened.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_libcuda.c")
DEFAULT_BUILD_DIR = Path(__file__).resolve().parents[1] / "_build" / "fakecuda"


def build(build_dir: Path = DEFAULT_BUILD_DIR) -> Path:
    """Compile the double (once per source version) and return the path of the shared library.

    The library is written under a temporary name and renamed, so concurrent test processes never
    load a half-written file.
    """
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = build_dir / digest / "libcuda.so.1"
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise RuntimeError("building the CUDA driver test double needs gcc (or $CC) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".libcuda.", suffix=".tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-soname,libcuda.so.1",
             "-o", tmp, str(SOURCE)],
            check=True, capture_output=True, text=True,
        )
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building the CUDA driver test double failed:\n{exc.stderr}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def ensure_libcuda(build_dir: Path = DEFAULT_BUILD_DIR) -> str:
    """Make ``dlopen("libcuda.so.1")`` succeed in this process; return ``"real"`` or ``"double"``.

    Must run before kvikio's first I/O in the process. Loading the double with ``RTLD_GLOBAL``
    under its soname is what lets kvikio's own ``dlopen`` find it; it is never loaded where a real
    driver opens, since it would shadow it.
    """
    try:
        opened = ctypes.CDLL("libcuda.so.1")
    except OSError:
        opened = None
    if opened is not None:  # a real driver, or the double loaded earlier (it has no cuInit)
        return "real" if hasattr(opened, "cuInit") else "double"
    ctypes.CDLL(str(build(build_dir)), mode=ctypes.RTLD_GLOBAL)
    return "double"
