"""Page-cache control for tests that need a chunk read from the disk (cold) rather than from
the kernel's cache (warm)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union


def drop_cached(path: Union[str, Path]) -> None:
    """Evict a file's pages from the page cache; made durable first, since dirty pages stay."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
