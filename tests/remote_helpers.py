"""Test helpers for the remote tier: a real S3 HTTP endpoint (moto's server on a free local
port), endpoints that refuse or never answer, and a "node": one process running the reference
engine with the TensorRT-LLM connector on its own local store and the shared bucket.

``python tests/remote_helpers.py JOB_JSON`` is the node (``run_node`` starts it): it prints one
JSON line with the outputs, the tokens served from the store, TTFT, and the remote tier's
counters of both connector halves.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

BUCKET = "gdskv-shared"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoEndpoint:
    """moto's S3 server (real HTTP, real S3 protocol) on 127.0.0.1; ``stop``/``start`` to take it away."""

    def __init__(self, port: Optional[int] = None) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.s3 = self.boto3()
        self.s3.create_bucket(Bucket=BUCKET)

    def boto3(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key="testing")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def stop(self) -> None:
        self._server.stop()


class SilentEndpoint:
    """A TCP port that accepts connections and never answers: every request hangs until its deadline."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self._held:
            c.close()


class FaultyProxy:
    """A real HTTP proxy on 127.0.0.1 in front of ``upstream`` (the moto server) that answers some
    requests itself: ``fault(method, path_and_query, headers)`` returns None to forward the request
    as it is, or one of ``"503"`` (a ``SlowDown`` error, as S3 sends under load), ``"500"``, any
    ``"<status> <S3 error code>"``, ``"slow"`` (forwarded after 100 ms),
    ``"reset"`` (the connection dropped before any answer), ``"stall"`` (no answer until the
    client gives up), ``"cut"`` (the upstream's status and headers, then half the body, then the
    connection closed). ``requests`` lists every request seen as (method, path_and_query, user agent)."""

    def __init__(self, upstream: str, fault: Any = None) -> None:
        import http.client
        import http.server
        import urllib.parse

        self.fault = fault or (lambda method, path, headers: None)
        self.requests: list[tuple[str, str, str]] = []
        self.in_flight = self.most_in_flight = 0
        """Requests being answered now, and the most there were at once."""
        self._lock = threading.Lock()
        up = urllib.parse.urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                with proxy._lock:
                    proxy.in_flight += 1
                    proxy.most_in_flight = max(proxy.most_in_flight, proxy.in_flight)
                try:
                    self._answer()
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.requests.append((self.command, self.path, self.headers.get("User-Agent", "")))
                what = proxy.fault(self.command, self.path, self.headers)
                if what == "slow":
                    time.sleep(0.1)
                    what = None
                if what == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.close_connection = True
                    return
                if what == "stall":
                    time.sleep(30)
                    self.close_connection = True
                    return
                if what and what[0].isdigit():
                    status, _, code = what.partition(" ")
                    code = code or {"503": "SlowDown"}.get(status, "InternalError")
                    err = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(int(status))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(err)))
                    self.end_headers()
                    self.wfile.write(err)
                    return
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
                    r = conn.getresponse()
                    data = r.read()
                finally:
                    conn.close()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if what == "cut":
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that gave up on a request (a broken pipe) is what the tests make happen

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def first(n: int, matches: Any, what: str) -> Any:
    """A ``FaultyProxy`` fault: ``what`` for the first ``n`` requests for which
    ``matches(method, path, headers)`` holds, then every request forwarded."""
    left = [n]
    lock = threading.Lock()

    def fault(method: str, path: str, headers: Any) -> Optional[str]:
        if not matches(method, path, headers):
            return None
        with lock:
            if left[0] <= 0:
                return None
            left[0] -= 1
            return what

    return fault


def save_chain(service: Any, keys: list[bytes], seed: int) -> None:
    """Save ``keys`` as one chain through ``service`` (a ``KvService``), each page random bytes
    drawn from ``seed``, each published before the next is saved, then close it: the store the
    remote tests push from."""
    import torch

    from gdskv.transfer import SaveStatus

    g = torch.Generator().manual_seed(seed)
    page = service.namespace.spec.groups[0].bytes_per_page
    for i, k in enumerate(keys):
        page_bytes = torch.randint(0, 256, (page,), dtype=torch.uint8, generator=g)
        assert service.save(0, k, keys[i - 1] if i else None, [page_bytes]).result(timeout=60) is SaveStatus.PUBLISHED
    service.close()


def remote_table(endpoint: str, prefix: str = "kv", **extra: Any) -> dict[str, Any]:
    return {"url": f"s3://{BUCKET}/{prefix}", "endpoint": endpoint, "region": "us-east-1", **extra}


def run_node(job: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """Run one node (``node_main``) in a fresh process; its JSON report."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **CREDENTIALS)
    proc = subprocess.run([sys.executable, __file__, json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def node_main(job: dict[str, Any]) -> dict[str, Any]:
    """Each of ``job["runs"]`` runs: a fresh connector (scheduler + worker) on the same config,
    the reference engine generating ``job["prompts"]``."""
    import torch

    from gdskv.config import GdsKvConfig
    from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
    from gdskv.engine.config import EngineConfig, ModelConfig
    from gdskv.engine.runtime import ReferenceEngine

    model = ModelConfig(**job.get("model", {}))
    tpb = job.get("tokens_per_block", 4)
    engine_cfg = EngineConfig(tokens_per_block=tpb, chunk_size=job.get("chunk", 64), num_slots=job.get("slots", 256))
    runs = []
    for _ in range(job.get("runs", 1)):
        row: dict[str, Any] = {}
        scheduler = worker = None
        if job.get("store"):
            cfg = GdsKvConfig(store_path=job["store"], remote=job.get("remote"))
            scheduler = GdsKvScheduler(StandaloneLlmArgs.build(model.fingerprint(), tpb), config=cfg)
            worker = GdsKvWorker(StandaloneLlmArgs.build(model.fingerprint(), tpb), config=cfg)
        engine = ReferenceEngine(model, engine_cfg, scheduler, [worker] if worker else None)
        t0 = time.perf_counter()
        results = engine.generate(job["prompts"], job.get("max_new", 4))
        row["wall_s"] = time.perf_counter() - t0
        row["tokens"] = [r.tokens for r in results]
        row["logits_sha"] = [_digest(torch.stack(r.logits)) for r in results]
        row["loaded"] = [r.prefill_tokens_loaded for r in results]
        row["ttft_s"] = [r.ttft_s for r in results]
        if worker is not None:
            tiers = [worker.service.remote, scheduler.service.remote]
            t1 = time.perf_counter()
            worker.close()
            row["close_s"] = time.perf_counter() - t1
            scheduler.service.close()
            row["worker"] = vars(worker.counters)
            row["remote_worker"], row["remote_scheduler"] = [t.counters.snapshot() if t else {} for t in tiers]
        runs.append(row)
    return {"runs": runs}


def _digest(t: Any) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def prompt(n: int, seed: int, vocab: int = 97) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def wait_for(cond: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps(node_main(json.loads(sys.argv[1]))))
