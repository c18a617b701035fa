"""Benchmark of the remote tier against a real S3 HTTP endpoint (moto's server, a separate process).

Prints, from one run:
1. GET throughput of the same objects: obstore (gdskv's client, ``get_many``) vs boto3 (a thread
   pool of ``concurrency`` workers): the client choice;
2. remote load throughput (a lookup's read-through: GET, verify trailer/keys/checksum, publish
   into an empty local store) vs a plain GET of the same objects with the same client, rounds
   interleaved, medians, and their ratio (target >= 0.9);
3. the timeout with the endpoint stopped, and with an endpoint that accepts and never answers:
   the longest lookup against ``timeout`` + one page load;
4. TTFT of node B's first run (prefix read through from the bucket) vs its own recompute, on the
   reference engine with the TensorRT-LLM connector.

``python scripts/bench_remote.py [--pages 64] [--page-size 1M] [--rounds 5] [--concurrency 16] [--no-ttft]``
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdskv.bench import sigterm_as_exit  # noqa: E402
from gdskv.config import GdsKvConfig, RemoteConfig, parse_size  # noqa: E402
from gdskv.keys import chain_keys  # noqa: E402
from gdskv.remote import ObjectClient  # noqa: E402
from gdskv.remote.objects import chunk_key  # noqa: E402
from gdskv.service import KvService  # noqa: E402
from gdskv.store import GroupSpec, NamespaceSpec  # noqa: E402

BUCKET = "gdskv-bench"
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``moto_server`` in its own process (so the client under test has this process to itself)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        self.boto3().create_bucket(Bucket=BUCKET)

    def boto3(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            config=Config(max_pool_connections=64))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def remote(url: str, prefix: str, **kw) -> dict:
    return {"url": f"s3://{BUCKET}/{prefix}", "endpoint": url, "region": "us-east-1", **kw}


def populate(server: Server, spec: NamespaceSpec, pages: int, work: Path) -> list[bytes]:
    tokens = list(range(pages * spec.tokens_per_block + 1))
    keys = chain_keys(tokens, spec.tokens_per_block)
    svc = KvService(GdsKvConfig(store_path=str(work / "node-a"), remote=remote(server.url, "b", upload="through")), spec)
    nbytes = spec.groups[0].bytes_per_page
    g = torch.Generator().manual_seed(0)
    futs = [svc.save(0, k, keys[i - 1] if i else None, [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)])
            for i, k in enumerate(keys)]
    for f in futs:
        f.result()
    svc.close()
    return keys


def bench_throughput(server: Server, spec: NamespaceSpec, keys: list[bytes], rounds: int, work: Path, concurrency: int) -> None:
    ns_probe = KvService(GdsKvConfig(store_path=str(work / "probe")), spec, transfers=False).namespace
    objs = [chunk_key(ns_probe, 0, k) for k in keys]
    total = sum(spec.groups[0].bytes_per_page + 128 for _ in keys)
    client = ObjectClient(RemoteConfig(**remote(server.url, "b", timeout="60s", concurrency=concurrency)))
    s3 = server.boto3()
    tokens = list(range(len(keys) * spec.tokens_per_block + 1))

    def plain_obstore() -> float:
        t0 = time.perf_counter()
        replies = client.get_many(objs, 60)
        assert all(r.data for r in replies)
        return time.perf_counter() - t0

    def plain_boto3() -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            got = list(pool.map(lambda k: s3.get_object(Bucket=BUCKET, Key=f"b/{k}")["Body"].read(), objs))
        assert all(got)
        return time.perf_counter() - t0

    cfg = GdsKvConfig(store_path=str(work / "node-b"), remote=remote(server.url, "b", timeout="60s", concurrency=concurrency))
    node_b = KvService(cfg, spec, transfers=False)  # one serving process: its client stays warm across lookups
    local = [node_b.namespace.chunk_path(0, k) for k in keys]

    def remote_load() -> float:
        for path in local:  # the chunks leave the local store (their directories stay, as in a store in service)
            if os.path.exists(path):
                os.unlink(path)
        t0 = time.perf_counter()
        found = node_b.lookup(tokens, None)
        took = time.perf_counter() - t0
        assert found.end_block == len(keys), found
        return took

    times: dict[str, list[float]] = {"obstore GET": [], "boto3 GET": [], "remote load": []}
    plain_obstore()  # warm connections
    remote_load()
    for r in range(rounds):
        times["obstore GET"].append(plain_obstore())
        times["remote load"].append(remote_load())
        times["boto3 GET"].append(plain_boto3())
    client.close()
    node_b.close()
    print(f"\n{len(keys)} objects of {spec.groups[0].bytes_per_page + 128} bytes ({total / 2**20:.0f} MiB), "
          f"concurrency {concurrency}, median of {rounds} interleaved rounds")
    print(f"| path | MB/s (median) | min..max |\n|---|---|---|")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"| {name} | {total / med[name] / 1e6:.0f} | {total / max(t) / 1e6:.0f}..{total / min(t) / 1e6:.0f} |")
    print(f"remote load / plain GET (obstore): {med['obstore GET'] / med['remote load']:.2f}  (target >= 0.9)")
    print(f"obstore / boto3 GET: {med['boto3 GET'] / med['obstore GET']:.2f}x")


def bench_timeout(server: Server, spec: NamespaceSpec, keys: list[bytes], work: Path, timeout: float) -> None:
    tokens = list(range(len(keys) * spec.tokens_per_block + 1))
    page_load = []
    for i in range(3):  # one page read through into an empty store
        cfg = GdsKvConfig(store_path=str(work / f"timing-{i}"), remote=remote(server.url, "b", timeout="60s"))
        svc = KvService(cfg, spec, transfers=False)
        t0 = time.perf_counter()
        svc.lookup(tokens[:spec.tokens_per_block + 1], None)
        page_load.append(time.perf_counter() - t0)
        svc.close()
    one_page = statistics.median(page_load)
    server.stop()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    rows = []
    for name, url in (("endpoint stopped", server.url), ("endpoint silent", f"http://127.0.0.1:{silent.getsockname()[1]}")):
        waits = []
        for r in range(3):
            store = work / f"down-{name[9:]}-{r}"
            s = KvService(GdsKvConfig(store_path=str(store), remote=remote(url, "b", timeout=f"{timeout}s")), spec, transfers=False)
            t0 = time.perf_counter()
            s.lookup(tokens, None)
            waits.append(time.perf_counter() - t0)
            s.close()
        rows.append((name, max(waits)))
    silent.close()
    print(f"\ntimeout {timeout:.2f} s; one page read through {one_page * 1e3:.1f} ms; bound {(timeout + one_page) * 1e3:.0f} ms")
    print("| remote | longest lookup (ms) | within timeout + one page |\n|---|---|---|")
    for name, w in rows:
        print(f"| {name} | {w * 1e3:.0f} | {'yes' if w <= timeout + one_page else 'NO'} |")


def bench_ttft(work: Path) -> None:
    from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
    from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine

    server = Server()
    model = ModelConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16,
                        intermediate_size=256, seed=7)
    tpb = 16
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (1000,), generator=g).tolist()]

    def run(store: str | None) -> tuple[float, list[int], int]:
        sched = worker = None
        if store is not None:
            cfg = GdsKvConfig(store_path=store, remote=remote(server.url, "ttft"))
            sched = GdsKvScheduler(StandaloneLlmArgs.build(model.fingerprint(), tpb), config=cfg)
            worker = GdsKvWorker(StandaloneLlmArgs.build(model.fingerprint(), tpb), config=cfg)
        eng = ReferenceEngine(model, EngineConfig(tokens_per_block=tpb, num_slots=128, chunk_size=256), sched,
                              [worker] if worker else None)
        r = eng.generate(prompts, 4)[0]
        if worker is not None:
            worker.close()
            sched.service.close()
        return r.ttft_s, r.tokens, r.prefill_tokens_loaded

    a = run(str(work / "ttft-a"))
    recompute = run(None)
    b1 = run(str(work / "ttft-b"))
    b2 = run(str(work / "ttft-b"))
    server.stop()
    assert a[1] == b1[1] == b2[1] == recompute[1]
    print(f"\nTTFT, reference engine (4 layers, hidden 128), prompt {len(prompts[0])} tokens, {tpb} tokens/block")
    print("| run | tokens served from the store | TTFT (ms) |\n|---|---|---|")
    for name, (ttft, _, loaded) in (("node A (computes, uploads)", a), ("node B recompute (no connector)", recompute),
                                    ("node B run 1 (read through the bucket)", b1), ("node B run 2 (local)", b2)):
        print(f"| {name} | {loaded} | {ttft * 1e3:.0f} |")
    print(f"node B run 1 vs its recompute: {recompute[0] / b1[0]:.1f}x faster")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", default="1M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=0.5)
    ap.add_argument("--no-ttft", action="store_true", help="Leave out the engine runs (4.).")
    args = ap.parse_args()
    page = parse_size(args.page_size)
    spec = NamespaceSpec("bench-remote", "uint8", 16, (GroupSpec(0, page, (0,)),))
    work = Path(tempfile.mkdtemp(prefix="gdskv-bench-remote-"))
    try:
        server = Server()
        keys = populate(server, spec, args.pages, work)
        bench_throughput(server, spec, keys, args.rounds, work, args.concurrency)
        bench_timeout(server, spec, keys, work, args.timeout)
        if not args.no_ttft:
            bench_ttft(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    with sigterm_as_exit():
        sys.exit(main())
