"""The ``gdskv`` commands, through click's runner on real stores, and end to end as subprocesses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from gdskv.cli.main import main
from gdskv.garbage import temp_file_is_stale, writer_pid
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, Namespace, NamespaceSpec, PageStore
from gdskv.transfer import PageTransfer

PAGE = 256
CHUNK = PAGE + 128
TPB = 4
REPO = Path(__file__).resolve().parents[1]


def _chains(n: int, blocks: int, shared: int = 2) -> list[list[int]]:
    """``n`` prompts that share their first ``shared`` blocks."""
    common = list(range(shared * TPB))
    return [common + [1000 * (i + 1) + t for t in range((blocks - shared) * TPB)] for i in range(n)]


def build_store(root: Path, chains: list[list[int]], groups: int = 2, model: str = "test/cli") -> Namespace:
    store = PageStore.open(root)
    ns = store.namespace(NamespaceSpec(model, "uint8", TPB, tuple(GroupSpec(g, PAGE, (g,)) for g in range(groups))))
    engine = PosixEngine(threads=2)
    xfer = PageTransfer(ns, engine, threads=2)
    for toks in chains:
        keys = chain_keys(toks, TPB)
        for g in range(groups):
            for i, k in enumerate(keys):
                page = torch.full((PAGE,), (i * 7 + g) % 251, dtype=torch.uint8)
                xfer.save_page(g, k, keys[i - 1] if i else None, [page]).result()
    xfer.close()
    engine.close()
    return ns


def run(store: Path | str, *args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, ["--store", str(store), *args], env=env, catch_exceptions=False)


def stored_prefix_ok(ns: Namespace, chains: list[list[int]], groups: int = 2) -> None:
    """Within each chain and group, what is stored is a prefix: nothing stays without its parent."""
    for toks in chains:
        for g in range(groups):
            present = ns.contains_many(g, chain_keys(toks, TPB))
            assert present == sorted(present, reverse=True), present


def chunk_bytes(root: Path) -> int:
    return sum(e.stat().st_size for _, _, e in PageStore.open(root, create=False).iter_chunk_files())


@pytest.fixture
def chains() -> list[list[int]]:
    return _chains(3, 5)


@pytest.fixture
def store(tmp_path: Path, chains: list[list[int]]) -> tuple[Path, Namespace]:
    root = tmp_path / "store"
    return root, build_store(root, chains)


# --- info / ls / stats -----------------------------------------------------------------------------
def test_info(store: tuple[Path, Namespace]) -> None:
    root, ns = store
    res = run(root, "info", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["format_version"] == 1 and rep["engine"]["selected"] == "posix"
    # 3 prompts x 5 blocks sharing 2 = 11 distinct blocks, in 2 groups
    assert rep["chunks"] == 22 and rep["bytes"] == 22 * CHUNK
    [n] = rep["namespaces"]
    assert n["id"] == ns.id and n["model"] == "test/cli" and [g["chunks"] for g in n["groups"]] == [11, 11]
    assert run(root, "info").exit_code == 0


def test_info_says_which_page_memory_direct_io_moves_in_place(store: tuple[Path, Namespace]) -> None:
    """``info`` reports the direct-I/O alignment the store's file system asks (statx, as the
    native reads and writes ask it), and says which pages move in place."""
    from test_transfer_batch import _dio_mem_align

    if os.uname().machine != "x86_64":
        pytest.skip("the test calls statx by its x86-64 system call number")
    root, _ = store
    rep = json.loads(run(root, "info", "--json").stdout)
    mem = _dio_mem_align(root / "zarr.json")
    text = run(root, "info").stdout
    if mem:
        assert rep["direct_io"]["memory_align"] == mem and rep["direct_io"]["offset_align"] > 0
        assert rep["direct_io"]["in_place_align"] == (mem if 4096 % mem == 0 else 4096)
        assert f"pages at {mem}-byte-aligned addresses move in place" in " ".join(text.split())
    else:
        assert rep["direct_io"] is None or rep["direct_io"]["offset_align"] == 0
        assert "direct" in text


def test_ls_filters_and_recency(store: tuple[Path, Namespace], chains: list[list[int]]) -> None:
    root, ns = store
    keys = chain_keys(chains[0], TPB)
    past = time.time_ns() - 10 * 86400 * 10**9
    for k in keys[2:]:
        os.utime(ns.chunk_path(1, k), ns=(past, past))
    rep = json.loads(run(root, "ls", "--json", "--limit", "0").stdout)
    assert rep["total"] == 22
    mtimes = [c["mtime_ns"] for c in rep["chunks"]]
    assert mtimes == sorted(mtimes, reverse=True)
    old = json.loads(run(root, "ls", "--json", "--older-than", "7d").stdout)
    assert {c["key"] for c in old["chunks"]} == {k.hex() for k in keys[2:]}
    assert all(c["group"] == 1 for c in old["chunks"])
    g0 = json.loads(run(root, "ls", "--json", "--group", "0", "--limit", "3").stdout)
    assert g0["total"] == 11 and len(g0["chunks"]) == 3 and all(c["group"] == 0 for c in g0["chunks"])
    assert run(root, "ls", "--namespace", "nope").exit_code == 2
    assert run(root, "ls").exit_code == 0


def test_stats_sums_every_process_file(store: tuple[Path, Namespace]) -> None:
    root, ns = store
    other = root / ".gdskv" / "stats" / "otherhost-1-1.json"
    other.write_text(json.dumps({"updated": 0, "namespaces": {ns.id: {"loads_hit": 5, "saves_published": 1}}}))
    (root / ".gdskv" / "stats" / "broken.json").write_text("{")
    rep = json.loads(run(root, "stats", "--json").stdout)
    assert rep["processes"] == 2 and rep["unreadable"] == ["broken.json"]
    assert rep["namespaces"][ns.id]["saves_published"] == 22 + 1
    assert rep["namespaces"][ns.id]["loads_hit"] == 5
    assert rep["models"][ns.id] == "test/cli"
    assert run(root, "stats").exit_code == 0


# --- verify ---------------------------------------------------------------------------------------
def test_verify_finds_and_repairs_bad_chunks(store: tuple[Path, Namespace], chains: list[list[int]],
                                             caplog: pytest.LogCaptureFixture) -> None:
    root, ns = store
    assert run(root, "verify").exit_code == 0
    keys = chain_keys(chains[1], TPB)
    flipped = ns.chunk_path(0, keys[3])
    with open(flipped, "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0xFF]))
    truncated = ns.chunk_path(1, keys[4])
    os.truncate(truncated, 100)
    foreign = ns.chunk_path(0, keys[2])
    Path(foreign).write_bytes(Path(ns.chunk_path(1, keys[2])).read_bytes())  # group 1's chunk at group 0's path
    res = run(root, "verify", "--json")
    assert res.exit_code == 1
    rep = json.loads(res.stdout)
    assert rep["bad"] == 3 and rep["ok"] == 19
    assert {(c["path"], c["reason"]) for c in rep["bad_chunks"]} == {
        (flipped, "bad-checksum"), (truncated, "truncated"), (foreign, "foreign-key")}
    assert "3 bad" in run(root, "verify").output
    caplog.clear()
    res = run(root, "verify", "--repair", "--json")
    assert res.exit_code == 1 and all(c["quarantined_to"] for c in json.loads(res.stdout)["bad_chunks"])
    assert not [r for r in caplog.records if "quarantine" in r.getMessage()]  # the report says it, once per chunk
    assert not os.path.exists(flipped) and len(list((root / ".gdskv" / "quarantine").rglob("*.*"))) == 3
    assert run(root, "verify").exit_code == 0


# --- evict ----------------------------------------------------------------------------------------
def test_evict_max_bytes_keeps_prefixes(store: tuple[Path, Namespace], chains: list[list[int]]) -> None:
    root, ns = store
    dry = json.loads(run(root, "evict", "--max-bytes", str(10 * CHUNK), "--dry-run", "--json").stdout)
    assert dry["victims"] == 12 and chunk_bytes(root) == 22 * CHUNK
    res = run(root, "evict", "--max-bytes", str(10 * CHUNK), "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["removed"] == 12 and rep["within_budget"]
    assert chunk_bytes(root) <= 10 * CHUNK
    stored_prefix_ok(ns, chains)
    # the shared prefix outlives the branches
    assert all(ns.contains_many(0, chain_keys(chains[0], TPB)[:2]))
    assert json.loads(run(root, "stats", "--json").stdout)["namespaces"][ns.id]["evicted"] == 12


def test_times_a_clock_ahead_left_neither_pin_nor_keep_chunks(store: tuple[Path, Namespace], chains: list[list[int]]) -> None:
    """An atime ten years ahead is no lookup's lease (leases run 30 s), and an mtime ten years
    ahead no use: from a clock that ran ahead, or a copy that kept times. Neither keeps a chain
    in the store for good, nor a temp file from ``gc``."""
    root, ns = store
    ahead = time.time_ns() + 10 * 365 * 86400 * 10**9
    now = time.time_ns()
    os.utime(ns.chunk_path(0, chain_keys(chains[0], TPB)[-1]), ns=(ahead, now))
    os.utime(ns.chunk_path(1, chain_keys(chains[1], TPB)[-1]), ns=(now, ahead))
    temp = Path(ns.chunk_path(0, chain_keys(chains[2], TPB)[0]) + ".tmp.999999.7")
    temp.write_bytes(b"x" * 10)
    os.utime(temp, ns=(ahead, ahead))
    res = run(root, "evict", "--max-bytes", "0", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["removed"] == 22, res.output
    res = run(root, "gc", "--min-age", "0s", "--json")
    assert res.exit_code == 0 and not temp.exists(), res.output


def test_evict_older_than_and_namespace(tmp_path: Path, chains: list[list[int]]) -> None:
    root = tmp_path / "s"
    a = build_store(root, chains, model="model/a")
    b = build_store(root, chains, model="model/b")
    past = time.time_ns() - 30 * 86400 * 10**9
    for _, _, e in PageStore.open(root).iter_chunk_files():
        os.utime(e.path, ns=(past, past))
    keys = chain_keys(chains[0], TPB)
    now = time.time_ns()
    os.utime(a.chunk_path(0, keys[-1]), ns=(now, now))  # a young tip
    rep = json.loads(run(root, "evict", "--older-than", "7d", "--namespace", a.id, "--json").stdout)
    assert rep["removed"] == 22 - 5  # chain 0 in group 0 stays whole: its tip is young
    assert all(a.contains_many(0, keys)) and not any(a.contains_many(1, keys))
    assert all(b.contains_many(0, keys)) and all(b.contains_many(1, keys))
    assert run(root, "evict", "--max-bytes", "10%", "--json").exit_code == 0  # 10% of the disk: nothing to do
    assert json.loads(run(root, "evict", "--max-bytes", "10%", "--json").stdout)["victims"] == 0


def test_evict_refuses_what_is_not_a_store(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "precious.txt").write_text("keep me")
    res = run(plain, "evict", "--max-bytes", "0")
    assert res.exit_code == 2 and "not a gdskv store" in res.output
    assert (plain / "precious.txt").read_text() == "keep me"
    assert run(tmp_path / "missing", "evict", "--max-bytes", "0").exit_code == 2
    for cmd in ("info", "ls", "stats", "verify", "gc"):
        assert run(plain, cmd).exit_code == 2


def test_evict_usage_errors(store: tuple[Path, Namespace]) -> None:
    root, _ = store
    assert run(root, "evict").exit_code == 2  # no limit given, none configured
    assert run(root, "evict", "--max-bytes", "lots").exit_code == 2
    assert run(root, "evict", "--older-than", "soon").exit_code == 2


def test_evict_uses_config_budget(store: tuple[Path, Namespace], tmp_path: Path) -> None:
    root, ns = store
    cfg = tmp_path / "gdskv.toml"
    cfg.write_text(f'max_bytes = {8 * CHUNK}\n')
    res = run(root, "evict", "--json", env={"GDSKV_CONFIG": str(cfg)})
    assert res.exit_code == 0, res.output
    assert chunk_bytes(root) <= 8 * CHUNK


# --- gc -------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_gc_rules() -> None:
    assert writer_pid("123.tmp.4567.ab12") == 4567 and writer_pid("x.json.tmp.99") == 99 and writer_pid("x.tmp.zz") is None
    dead, alive = _dead_pid(), os.getppid()
    assert temp_file_is_stale(f"1.tmp.{dead}.aa", age_s=120, min_age_s=60, grace_s=3600)
    assert not temp_file_is_stale(f"1.tmp.{dead}.aa", age_s=5, min_age_s=60, grace_s=3600)
    assert not temp_file_is_stale(f"1.tmp.{alive}.aa", age_s=120, min_age_s=60, grace_s=3600)
    assert temp_file_is_stale(f"1.tmp.{alive}.aa", age_s=4000, min_age_s=60, grace_s=3600)


def test_gc_removes_leftovers_only(store: tuple[Path, Namespace], chains: list[list[int]]) -> None:
    root, ns = store
    before = sorted(str(p) for p in root.rglob("*"))
    chunk = ns.chunk_path(0, chain_keys(chains[0], TPB)[0])
    old = time.time() - 600
    dead_tmp = f"{chunk}.tmp.{_dead_pid()}.beef"
    live_tmp = f"{chunk}.tmp.{os.getppid()}.cafe"
    stats_tmp = str(root / ".gdskv" / "stats" / f"h-1-2.json.tmp.{_dead_pid()}")
    for p in (dead_tmp, live_tmp, stats_tmp):
        Path(p).write_bytes(b"partial")
        os.utime(p, (old, old))
    empty = ns.array_path(0) / "c" / "4095" / "0"
    empty.mkdir(parents=True)
    for d in (empty, empty.parent):
        os.utime(d, (old, old))
    dry = json.loads(run(root, "gc", "--dry-run", "--json").stdout)
    assert sorted(dry["temp_files"]) == sorted([dead_tmp, stats_tmp])
    res = run(root, "gc", "--json")
    assert res.exit_code == 0
    rep = json.loads(res.stdout)
    assert rep["removed_temp_files"] == 2 and rep["removed_dirs"] == 2
    after = sorted(str(p) for p in root.rglob("*"))
    assert after == sorted(before + [live_tmp])
    assert run(root, "verify").exit_code == 0


# --- prewarm --------------------------------------------------------------------------------------
PARAGRAPHS = [
    "You are a careful assistant. Answer in one short sentence, and cite the manual section you used.",
    "The quick brown fox jumps over the lazy dog while the store keeps every block it has seen.",
]


def _prompt_files(tmp_path: Path) -> tuple[Path, Path]:
    txt = tmp_path / "prompts" / "a.txt"
    txt.parent.mkdir()
    txt.write_text("\n\n".join(PARAGRAPHS) + "\n")
    jsonl = tmp_path / "prompts" / "b.jsonl"
    jsonl.write_text("\n".join([
        json.dumps({"prompt": PARAGRAPHS[0] + " What is a KV cache?"}),
        json.dumps({"messages": [{"role": "system", "content": PARAGRAPHS[0]}, {"role": "user", "content": "hello"}]}),
        json.dumps({"prompt": ""}),
        "{not json",
        json.dumps({"prompt": "x" * 600}),
    ]) + "\n")
    return txt, jsonl


def test_prewarm_reference(tmp_path: Path) -> None:
    txt, jsonl = _prompt_files(tmp_path)
    root = tmp_path / "store"
    res = run(root, "prewarm", str(txt.parent), "--max-prompt-tokens", "512", "--json", env={"GDSKV_STORE": str(root)})
    assert res.exit_code == 1  # three bad prompts were skipped
    rep = json.loads(res.stdout)
    assert rep["prompts"] == 7 and rep["done"] == 4 and len(rep["failed"]) == 3
    reasons = " ".join(f["error"] for f in rep["failed"])
    assert "empty" in reasons and "not JSON" in reasons and "too long" in reasons
    assert rep["blocks_written"] > 0 and rep["bytes_written"] > 0
    # the jsonl prompt shares the first paragraph's blocks
    assert rep["blocks_present"] >= len(PARAGRAPHS[0].encode()) // 16 - 1
    again = json.loads(run(root, "prewarm", str(txt), "--json", env={"GDSKV_STORE": str(root)}).stdout)
    assert again["done"] == 2 and again["blocks_written"] == 0 and again["blocks_present"] > 0
    assert run(root, "verify").exit_code == 0


def test_store_delta_counts_the_whole_run_in_two_scans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TensorRT-LLM / MAX / vLLM runners measure what the run added on the store: one scan
    when the runner is made, one once the engine stopped, however many prompts ran between, so
    blocks the engine wrote during its prompts and as it stopped are all counted, and nothing
    that was there before."""
    from gdskv.cli.prewarm import StoreDelta
    from gdskv.config import GdsKvConfig

    root = tmp_path / "store"
    scans, measure = [], StoreDelta._measure
    monkeypatch.setattr(StoreDelta, "_measure", lambda self: scans.append(1) or measure(self))
    delta = StoreDelta(GdsKvConfig(store_path=str(root)))
    build_store(root, _chains(1, 3))  # the prompts: 3 blocks in 2 groups
    build_store(root, _chains(2, 3))  # written as the engine stopped: one new block in 2 groups
    run_total = delta.written()
    assert (run_total.blocks_written, run_total.bytes_written) == (8, 8 * CHUNK) and len(scans) == 2
    again = StoreDelta(GdsKvConfig(store_path=str(root)))
    assert (again.written().blocks_written, again.written().bytes_written) == (0, 0)  # what was there is not counted


def test_prewarm_usage(tmp_path: Path) -> None:
    root = tmp_path / "store"
    bad = tmp_path / "p.csv"
    bad.write_text("a,b")
    assert run(root, "prewarm", str(bad)).exit_code == 2
    assert run(root, "prewarm", str(tmp_path / "none.txt")).exit_code == 2
    assert run(root, "prewarm", "--engine", "max", str(bad)).exit_code == 2


# --- bench ----------------------------------------------------------------------------------------
def test_bench_runs_the_store_benchmark(tmp_path: Path) -> None:
    res = run(tmp_path / "store", "bench", "--total", "2M", "--page-size", "1M", "--rounds", "1", "--engines", "posix",
              "--peers", "", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    rows = {r["subject"]: r for r in rep["results"]}
    assert set(rows) >= {"store:posix@torch", "raw", "ceiling", "files"}
    store, files = rows["store:posix@torch"], rows["files"]
    assert files["load_warm_gbps"] > 0 and store["warm_vs_files"] == store["load_warm_gbps"] / files["load_warm_gbps"]


def test_bench_plot_needs_matplotlib(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert run(tmp_path / "store", "bench", "--plot", str(tmp_path / "o.png")).exit_code == 2
        return
    res = run(tmp_path / "store", "bench", "--plot", str(tmp_path / "o.png"), "--total", "2M", "--page-size", "1M", "--rounds", "1", "--engines", "posix", "--peers", "")
    assert res.exit_code == 0 and (tmp_path / "o.png").stat().st_size > 0


# --- end to end, as subprocesses ---------------------------------------------------------------------
def gdskv(store: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GDSKV_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "gdskv.cli.main", "--store", str(store), *args],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)


@pytest.mark.slow
def test_e2e_verify_evict_gc(tmp_path: Path) -> None:
    chains = _chains(4, 6)
    root = tmp_path / "store"
    ns = build_store(root, chains)
    assert gdskv(root, "verify").returncode == 0
    victim = ns.chunk_path(1, chain_keys(chains[2], TPB)[1])
    data = bytearray(Path(victim).read_bytes())
    data[PAGE // 2] ^= 1
    Path(victim).write_bytes(bytes(data))
    p = gdskv(root, "verify", "--json")
    assert p.returncode == 1 and [c["path"] for c in json.loads(p.stdout)["bad_chunks"]] == [victim]

    budget = 14 * CHUNK
    p = gdskv(root, "evict", "--max-bytes", str(budget), "--json")
    assert p.returncode == 0, p.stderr
    assert chunk_bytes(root) <= budget
    stored_prefix_ok(ns, chains)

    plain = tmp_path / "plain"
    plain.mkdir()
    p = gdskv(plain, "evict", "--max-bytes", "1")
    assert p.returncode == 2 and "not a gdskv store" in p.stderr

    leftover = ns.chunk_path(0, chain_keys(chains[0], TPB)[0]) + f".tmp.{_dead_pid()}.0bad"
    Path(leftover).write_bytes(b"torn")
    os.utime(leftover, (time.time() - 3600 * 2, time.time() - 3600 * 2))
    before = sorted(str(x) for x in root.rglob("*"))
    p = gdskv(root, "gc", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["temp_files"] == [leftover]
    assert sorted(str(x) for x in root.rglob("*")) == [x for x in before if x != leftover]


GENERATE = textwrap.dedent("""
    import json, sys
    import torch
    from gdskv.cli.prewarm import ByteTokenizer, reference_stack, reference_model_config
    from gdskv.config import load_config
    from gdskv.engine import EngineConfig, ReferenceEngine
    store, text = sys.argv[1], sys.argv[2]
    ids = ByteTokenizer().encode(text)
    stack = reference_stack(load_config(store_path=store), 256, 1024, max_new_tokens=8)
    [warm] = stack.engine.generate([ids], max_new_tokens=8)
    stack.close()
    cold_engine = ReferenceEngine(reference_model_config(256), stack.engine.engine_cfg)
    [cold] = cold_engine.generate([ids], max_new_tokens=8, split_prefill_at=warm.prefill_tokens_loaded)
    print(json.dumps({"loaded": warm.prefill_tokens_loaded, "hits": stack.worker.counters.loads_loaded,
                      "tokens": warm.tokens, "cold_tokens": cold.tokens,
                      "logits_equal": all(torch.equal(a, b) for a, b in zip(warm.logits, cold.logits))}))
""")


@pytest.mark.slow
def test_e2e_prewarm_then_a_new_process_loads_the_prefix(tmp_path: Path) -> None:
    txt, _ = _prompt_files(tmp_path)
    root = tmp_path / "store"
    p = gdskv(root, "prewarm", str(txt), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["blocks_written"] > 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GDSKV_CONFIG", None)
    out = subprocess.run([sys.executable, "-c", GENERATE, str(root), PARAGRAPHS[1]], capture_output=True, text=True,
                         env=env, cwd=str(REPO), timeout=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    assert rep["hits"] > 0 and rep["loaded"] >= (len(PARAGRAPHS[1]) // 16 - 1) * 16
    assert rep["tokens"] == rep["cold_tokens"] and rep["logits_equal"]


def test_bring_up_cleans_a_dead_writers_temp_file_in_the_background(tmp_path):
    """Promise 5: crash leftovers are cleaned at open, not only by ``gdskv gc``."""
    from gdskv.garbage import collect_in_background

    store = PageStore.open(tmp_path / "s")
    ns = store.namespace(NamespaceSpec("m", "float16", 4, (GroupSpec(0, 64, (0,)),)))
    dead = _dead_pid()
    leftover = Path(ns.chunk_path(0, b"k" * 32) + f".tmp.{dead}.abcd1234")
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"torn")
    old = time.time() - 120
    os.utime(leftover, (old, old))
    fresh = leftover.with_name(f"7.tmp.{dead}.ffff0000")
    fresh.write_bytes(b"still young")
    collect_in_background(store).join(30)
    assert not leftover.exists() and fresh.exists()


def test_a_usage_mistake_is_one_line(tmp_path: Path) -> None:
    """An unknown option or command, a missing value: one line on stderr, exit 2, not click's usage
    block (docs/cli.md), naming the command where click knows it; ``--help`` still prints the help."""
    for args, said in ((("info", "--bogus"), "main info: No such option '--bogus'"),  # prog: python -m gdskv.cli.main
                       (("--bogus", "info"), "main: No such option '--bogus'"),
                       (("nosuchcmd",), "main: No such command 'nosuchcmd'"),
                       (("evict", "--max-bytes"), "Error: Option '--max-bytes' requires an argument")):
        res = gdskv(tmp_path / "store", *args)
        assert res.returncode == 2 and res.stdout == "", res
        assert res.stderr.count("\n") == 1 and said in res.stderr and "Usage:" not in res.stderr, res.stderr
    res = gdskv(tmp_path / "store", "info", "--help")
    assert res.returncode == 0 and "Usage:" in res.stdout


def test_help_lists_every_command_by_its_own_summary_without_importing_them() -> None:
    """``gdskv --help`` lists each command with the first line of its own help (the summaries in
    ``COMMANDS`` are kept equal to them), without importing torch or any command's module."""
    import click

    from gdskv.cli.main import COMMANDS

    ctx = click.Context(main)
    assert {n: main.get_command(ctx, n).get_short_help_str(limit=1000) for n in COMMANDS} == COMMANDS
    probe = ("import sys; from gdskv.cli.main import main; rc = main(['--help'], standalone_mode=False); "
             "print([m for m in sys.modules if m == 'torch' or m.startswith('gdskv.cli.') and m.rsplit('.', 1)[1] in "
             "('info', 'ls', 'stats', 'verify', 'evict', 'gc', 'prewarm', 'push', 'pull', 'bench', 'demo')])")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert res.returncode == 0, res.stderr
    listing = res.stdout.split("Commands:", 1)[1]
    assert all(name in listing for name in COMMANDS) and COMMANDS["verify"] in " ".join(listing.split())
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout


def test_bench_answers_a_bad_option_with_one_line(tmp_path: Path) -> None:
    for args, said in ((("--page-size", "3K"), "page size must be a multiple of 512 bytes"),
                       (("--page-size", "3X"), "argument --page-size: not a size: '3X'"),
                       (("--rounds", "0"), "--rounds must be at least 1"),
                       (("--peers", "sglang"), "unknown peer 'sglang'"),
                       (("--dir", str(tmp_path / "absent")), f"--dir: not a directory: {tmp_path / 'absent'}"),
                       (("--total", "x"), "argument --total: not a size: 'x'"),
                       (("--total", "0"), "argument --total: must be more than 0 bytes"),
                       (("--kvikio-task-size", "1K"), "--kvikio-task-size: gdskv config: kvikio_task_size must be at least"),
                       (("--io-threads", "0"), "--io-threads: gdskv config: io_threads must be an integer in [1, 256]"),
                       (("--transfer-threads", "0"), "--transfer-threads: gdskv config: io_threads must be an integer"),
                       (("--kvikio-threads", "999"), "--kvikio-threads: gdskv config: kvikio_threads must be an integer")):
        res = gdskv(tmp_path / "store", "bench", "--", *args)
        assert res.returncode == 2 and res.stdout == "", res
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("gdskv bench: ") and said in res.stderr, res.stderr
