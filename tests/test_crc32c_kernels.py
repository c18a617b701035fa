"""The carry-less-multiplication CRC32C kernels of ``gdskv._crc32c`` (what ``gdskv.format``
seals and checks pages with, and the native batch path checksums every chunk it reads with) give
exactly google-crc32c's CRC32C: every length around the kernels' block and fold boundaries,
unaligned starts, a continued CRC, and whole pages; ``gdskv.format`` gives the same value with or
without them."""
from __future__ import annotations

import ctypes
import json
import random
import subprocess
import sys
from pathlib import Path

import google_crc32c
import pytest

from gdskv import format as fmt

try:
    from gdskv import _crc32c
except ImportError:  # built by pip install where a C compiler is present
    _crc32c = None
KERNELS = ("vpclmul", "hybrid", "pclmul", "chains", None)


@pytest.fixture(params=KERNELS, ids=lambda k: k or "chosen")
def kernel(request):
    if _crc32c is None:
        pytest.skip("gdskv._crc32c is not built in this environment")
    if _crc32c.crc32c(b"", 0, request.param) is None:
        pytest.skip(f"this CPU cannot run the {request.param or 'chosen'} CRC32C kernel")
    return request.param


def test_every_length_and_start_around_the_fold_boundaries_matches_google_crc32c(kernel):
    rng = random.Random(7)
    data = rng.randbytes(4096)
    for n in list(range(0, 1100)) + [2047, 2048, 2049, 4000]:
        start = rng.randrange(0, 64)
        piece = data[start:start + n]
        value = rng.getrandbits(32) if n % 3 else 0
        assert _crc32c.crc32c(piece, value, kernel) == google_crc32c.extend(value, piece), (n, start)


@pytest.mark.parametrize("block", [256 * 128 + 3 * 40 * 128, 3 * 8192], ids=["hybrid", "chains"])
def test_lengths_around_the_block_kernels_blocks_match_google_crc32c(kernel, block):
    """The hybrid kernel works in blocks of 48128 bytes (32 KiB of folds, three 5 KiB crc32
    chains) and leaves the rest to vpclmul, the chains kernel in blocks of three 8 KiB chains:
    every kernel at and around one, two and five of either."""
    rng = random.Random(11)
    data = rng.randbytes(5 * block + 600)
    for n in [block - 1, block, block + 1, block + 255, 2 * block - 8, 2 * block, 2 * block + 7, 5 * block + 513]:
        start = rng.randrange(0, 64)
        piece = data[start:start + n]
        value = rng.getrandbits(32)
        assert _crc32c.crc32c(piece, value, kernel) == google_crc32c.extend(value, piece), (n, start)


def test_whole_pages_and_a_crc_continued_across_pieces_match(kernel):
    rng = random.Random(8)
    for size in (64 << 10, (1 << 20) + 3, 4 << 20):
        page = rng.randbytes(size)
        whole = google_crc32c.value(page)
        assert _crc32c.crc32c(page, 0, kernel) == whole
        cut = rng.randrange(1, size)
        assert _crc32c.crc32c(page[cut:], _crc32c.crc32c(page[:cut], 0, kernel), kernel) == whole


def test_one_flipped_bit_changes_the_crc(kernel):
    page = bytearray(random.Random(9).randbytes(1 << 20))
    before = _crc32c.crc32c(bytes(page), 0, kernel)
    page[123_457] ^= 0x10
    assert _crc32c.crc32c(bytes(page), 0, kernel) != before


def test_an_unknown_kernel_name_is_none():
    if _crc32c is None:
        pytest.skip("gdskv._crc32c is not built in this environment")
    assert _crc32c.crc32c(b"abc", 0, "no-such-kernel") is None


def test_format_gives_the_same_crc_with_or_without_the_kernels(monkeypatch):
    page = bytearray(random.Random(10).randbytes((1 << 20) + 5))
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    fast = (fmt.crc32c(page), fmt.crc32c(bytes(page), 11), fmt.crc32c_at(address, len(page), 11))
    monkeypatch.setattr(fmt, "_FAST", None)
    assert fast == (google_crc32c.value(bytes(page)), fmt.crc32c(bytes(page), 11), fmt.crc32c_at(address, len(page), 11))
    assert fast[1] == google_crc32c.extend(11, bytes(page))


def test_bench_checksum_shows_both_crc32c_rows_and_answers_a_bad_size_in_one_line():
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_checksum.py"
    run = subprocess.run([sys.executable, str(script), "--sizes", "64K", "--seconds", "0.02", "--repeats", "1", "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["results"]
    assert rows["crc32c (host)"]["64K"] > 0 and rows["crc32c google-crc32c (host)"]["64K"] > 0
    bad = subprocess.run([sys.executable, str(script), "--sizes", "64K,bad"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "bench_checksum: argument --sizes: not a size: 'bad' (expected e.g. 4096, 512M, 500G)\n"
