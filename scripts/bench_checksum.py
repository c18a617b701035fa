"""Payload checksum and MAC throughput, GB/s, on torch tensors (CPU by default).

    python scripts/bench_checksum.py [--sizes 256K,1M,4M] [--device cpu|cuda] [--threads N] [--json]

Rows: CRC32C (``gdskv.format.crc32c_at``, host memory only: ``gdskv._crc32c``'s folding kernel
where it runs, and google-crc32c's for comparison), the device checksum
``gdskv.checksum.poly_hash`` (torch, on ``--device``) and its numpy host form, the two MAC
candidates (HMAC-SHA256, keyed BLAKE2b; ``chunk_mac`` uses HMAC-SHA256), and for a device other
than the CPU the copy to the host that a MAC (or CRC32C) of a device page needs. Each figure is
the median of ``--repeats`` timings of as many calls as fill ``--seconds``.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import google_crc32c  # noqa: E402
import torch  # noqa: E402

from gdskv import checksum as cs  # noqa: E402
from gdskv import format as fmt  # noqa: E402
from gdskv.bench import OneLineParser  # noqa: E402
from gdskv.config import parse_size  # noqa: E402


def _rate(fn: Callable[[], object], nbytes: int, seconds: float, repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    rates = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            sync()
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        rates.append(n * nbytes / dt / 1e9)
    return statistics.median(rates)


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(s) for s in text.split(",")]
    except ValueError as e:  # argparse would say "invalid _sizes value"
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="bench_checksum", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=_sizes, default="256K,1M,4M", help="page sizes, comma separated")
    ap.add_argument("--device", default="cpu", help="torch device of the page (cpu, cuda, cuda:1 ...)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    opts = ap.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sizes = opts.sizes
    key = os.urandom(32)
    rows: dict[str, dict[str, float]] = {}
    for n in sizes:
        page = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
        host = page.cpu()
        view = memoryview(host.numpy())
        ptr = host.data_ptr()
        subjects: dict[str, Callable[[], object]] = {
            "crc32c (host)": lambda: fmt.crc32c_at(ptr, n),
            f"poly_hash (torch, {device})": lambda: cs.poly_hash([page]),
            "poly_hash_host (numpy)": lambda: cs.poly_hash_host(view),
            "hmac-sha256 (host)": lambda: hmac.new(key, view, hashlib.sha256).digest(),
            "blake2b keyed (host)": lambda: hashlib.blake2b(view, key=key, digest_size=32).digest(),
        }
        as_bytes = bytes(view)  # google-crc32c's binding reads bytes in place
        subjects["crc32c google-crc32c (host)"] = lambda: google_crc32c.extend(0, as_bytes)
        if device.type != "cpu":
            subjects[f"copy {device} -> host"] = lambda: page.to("cpu")
            subjects["crc32c of a device page"] = lambda: cs.crc32c_segments([page])
        for name, fn in subjects.items():
            rows.setdefault(name, {})[fmt_size(n)] = round(_rate(fn, n, opts.seconds, opts.repeats, sync), 3)
    report = {"device": str(device), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "unit": "GB/s", "results": rows}
    if opts.json:
        print(json.dumps(report, indent=2))
        return 0
    cols = [fmt_size(n) for n in sizes]
    width = max(len(r) for r in rows)
    print(f"GB/s on {device}, torch threads {report['torch_threads']}, {report['cpus']} CPUs")
    print(f"| {'subject':<{width}} | " + " | ".join(f"{c:>6}" for c in cols) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * 7 + ":" for _ in cols) + "|")
    for name, vals in rows.items():
        print(f"| {name:<{width}} | " + " | ".join(f"{vals[c]:>6.2f}" for c in cols) + " |")
    return 0


def fmt_size(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
