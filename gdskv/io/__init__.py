"""I/O engines: move page bytes between memory and files (see ``base.IoEngine``)."""
from __future__ import annotations

from gdskv.config import ConfigError, GdsKvConfig
from gdskv.io.base import IoEngine, Segment, ShortReadError
from gdskv.io.capabilities import cuda_driver_present, kvikio_available
from gdskv.io.posix import PosixEngine

__all__ = ["IoEngine", "Segment", "ShortReadError", "PosixEngine", "make_engine"]


def make_engine(cfg: GdsKvConfig) -> IoEngine:
    """The engine the config asks for; ``auto`` picks kvikio when it is installed and a CUDA
    driver is present, POSIX otherwise. Called once per worker at bring-up (connectors, demo,
    ``gdskv info``, the benchmarks); the caller owns the engine and closes it."""
    choice = cfg.engine
    if choice == "auto":
        choice = "kvikio" if kvikio_available() and cuda_driver_present() else "posix"
    if choice == "kvikio":
        if not kvikio_available():
            raise ConfigError("gdskv config: engine = 'kvikio' but kvikio is not installed (pip install 'gdskv[cu12]' or 'gdskv[cu13]')")
        from gdskv.io.kvikio_engine import KvikioEngine

        return KvikioEngine(threads=cfg.kvikio_threads, task_size=cfg.kvikio_task_size, fsync=cfg.fsync,
                            direct_writes=cfg.o_direct != "off", direct_reads=cfg.o_direct == "all",
                            file_mode=cfg.file_mode)
    return PosixEngine(threads=cfg.io_threads, o_direct=cfg.o_direct != "off", fsync=cfg.fsync, direct_reads=cfg.o_direct == "all",
                       file_mode=cfg.file_mode)
