"""gdskv's KVConnector inside a real Modular MAX pipeline, on CPU (``pytest -m max``).

Installs ``max[serve]==26.7.0`` into its own virtualenv (``GDSKV_MAX_VENV``, default
``~/.cache/gdskv-test/venv-max``, kept between runs and reused when it already has what the
test needs), together with gdskv's own dependencies (read from ``pyproject.toml``) and this
checkout of gdskv (``pip install --no-deps -e``, redone when the checkout moved), builds a tiny random fp32
Llama offline (``scripts/make_tiny_llama.py``), and runs ``max generate --devices cpu`` in
separate processes on one store:

1. plain ``max generate`` without gdskv: the reference output;
2. with the connector on an empty store: the prompt's full blocks are offloaded;
3. a second process: the prompt's blocks are loaded from the store, same output;
4. after corrupting one chunk, ``max serve`` with one completion request: the load fails
   (counted), MAX's scheduler recomputes the prefix, same output, and the block is stored again.
   (``max generate`` cannot take this case in MAX 26.7: its loop waits on a load with
   ``synchronize()`` and runs the step without polling, so MAX itself stops with "ran past an
   onload whose copy failed"; the serving scheduler holds the request back and polls.)
5. after overwriting every chunk with well-formed zero KV: the blocks load and the output
   changes, so the equality in 3 is evidence that the loaded KV is what the model read;
6. on a second store, ``gdskv prewarm --engine max`` then ``max generate``: every block loaded,
   same output. These two overlap runs 2-4 on the first store (each run is mostly MAX's
   start-up; alone on 2 cores the file takes about 30 s less).

It is part of the default test run (``-m "not max"`` leaves it out): the first run on a machine
downloads about 1.3 GB and compiles for minutes; MAX's compile cache lives in the virtualenv
(``modular-cache``, ``MODULAR_CACHE_DIR``), so later runs take about two minutes.
``docs/max.md`` has the timings.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_venv import EngineVenv

from gdskv import format as fmt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
try:
    from max_ttft import Server, max_env  # the bench's MAX harness: one way to run max serve
finally:
    sys.path.pop(0)

pytestmark = pytest.mark.max

VENV = Path(os.environ.get("GDSKV_MAX_VENV") or Path.home() / ".cache" / "gdskv-test" / "venv-max")
MAX_REQUIREMENT = "max[serve]==26.7.0"
PAGE_TOKENS = 128
PROMPT = " ".join(["the store is a zarr hierarchy with one chunk per block hash"] * 15)
RUN_TIMEOUT = 900


ENGINE = EngineVenv(VENV, MAX_REQUIREMENT, "import max.pipelines, transformers", "gdskv.connectors.max",
                    lambda: _env({}))


@pytest.fixture(scope="session")
def max_python() -> Path:
    """The MAX virtualenv's interpreter (``tests/engine_venv.py``: made or completed when needed,
    MAX downloaded once per machine)."""
    return ENGINE.ensure()


@pytest.fixture(scope="session")
def tiny_llama(max_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([str(max_python), str(REPO / "scripts" / "make_tiny_llama.py"), str(out)], check=True,
                   env=_env({}))
    return out


def _env(extra: dict[str, str]) -> dict[str, str]:
    return max_env(VENV / "bin" / "python", extra)


@dataclass
class Run:
    """One ``max generate`` process: its generated text, connector counters and wall time."""

    text: str
    prompt_tokens: int
    stats: dict
    seconds: float


def _generate_cmd(python: Path, model: Path, store: Path | None, stats_file: Path | None) -> tuple[list[str], dict[str, str]]:
    args = ["generate", "--model-path", str(model), "--devices", "cpu", "--prompt", PROMPT,
            "--max-new-tokens", "8", "--top-k", "1", "--seed", "0", "--max-length", "1024",
            "--max-batch-size", "1"]
    if store is None:
        cmd = [str(python), "-c", "import sys; from max._entrypoints.pipelines import main; sys.argv[0] = 'max'; sys.exit(main())"] + args
        extra: dict[str, str] = {}
    else:
        cmd = [str(python), "-m", "gdskv.connectors.max_launch"] + args + ["--kv-connector-config", '{"type":"rust_tiered"}']
        extra = {"GDSKV_STORE": str(store), "GDSKV_MAX_METRICS": str(stats_file)}
    return cmd, _env(extra)


def _finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class Generating:
    """One ``max generate`` process, started at once and waited for by ``result()``, so that
    runs on different stores overlap (most of a run is MAX's start-up)."""

    def __init__(self, python: Path, model: Path, store: Path | None, stats_file: Path | None):
        self.cmd, env = _generate_cmd(python, model, store, stats_file)
        self.stats_file = stats_file
        self.start = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     errors="replace", env=env, cwd=REPO)

    def result(self) -> Run:
        done = _finish(self.proc)
        seconds = time.monotonic() - self.start
        assert done.returncode == 0, f"{' '.join(self.cmd[:4])} failed:\n{done.stderr[-4000:]}"
        text, sep, tail = done.stdout.partition("\nPrompt size: ")
        assert sep, f"unexpected max generate output:\n{done.stdout[-2000:]}"
        stats = json.loads(self.stats_file.read_text()) if self.stats_file is not None else {}
        return Run(text, int(tail.split()[0]), stats, seconds)


def _generate(python: Path, model: Path, store: Path | None, stats_file: Path | None) -> Run:
    return Generating(python, model, store, stats_file).result()


def _serve_once(python: Path, model: Path, store: Path, stats_file: Path) -> Run:
    """``max serve`` with the connector (``scripts/max_ttft.py``'s ``Server``), one greedy
    completion of the prompt, then SIGINT."""
    start = time.monotonic()
    with Server(python, model, 1024, store, stats_file, log=stats_file.with_suffix(".log")) as server:
        _, text, prompt_tokens = server.complete(PROMPT, 8)
    return Run(text, prompt_tokens, json.loads(stats_file.read_text()), time.monotonic() - start)


def _chunks(store: Path) -> list[Path]:
    return sorted(p for p in (store / "ns").glob("*/g*/c/*/0/*") if p.is_file() and fmt.TMP_MARK not in p.name)


def _flip_payload_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))


def _zero_payload(path: Path) -> None:
    """Rewrite a chunk with an all-zero payload and a trailer that matches it: well-formed KV,
    just not the KV of its tokens."""
    raw = path.read_bytes()
    t = fmt.unpack(raw[-fmt.TRAILER_BYTES:])
    payload = bytes(t.payload_nbytes)
    trailer = fmt.pack(fmt.Trailer(t.layer_group, t.payload_nbytes, fmt.crc32c(payload), t.store_key, t.block_key,
                                   t.parent_key))
    path.write_bytes(payload + trailer)


@dataclass
class Session:
    baseline: Run
    first: Run
    second: Run
    corrupted: Run
    zeroed: Run
    chunks_after_first: int
    chunk_bytes: int
    prewarm: subprocess.CompletedProcess
    prewarm_chunks: int
    after_prewarm: Run


def _start_prewarm(python: Path, model: Path, store: Path, prompts: Path) -> subprocess.Popen:
    return subprocess.Popen([str(python), "-m", "gdskv.cli.main", "--store", str(store), "prewarm", "--engine", "max",
                             "--model", str(model), "--engine-arg", "max_length=1024", "--engine-arg", "max_batch_size=1",
                             "--json", str(prompts)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", env=_env({}),
                            cwd=REPO)


@pytest.fixture(scope="module")
def session(max_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Session:
    """Every MAX run of this file's tests, on two stores: the connector's own runs on ``store``
    (one after another: each reads what the one before left) and ``gdskv prewarm`` then a
    generate on ``prewarmed``, each overlapping one run on the other store. The plain run goes
    first, alone: on a new machine it fills MAX's compile cache that every later run reads."""
    work = tmp_path_factory.mktemp("max-runs")
    store, prewarmed = work / "store", work / "prewarmed"
    prompts = work / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    baseline = _generate(max_python, tiny_llama, None, None)

    prewarming = _start_prewarm(max_python, tiny_llama, prewarmed, prompts)
    first = _generate(max_python, tiny_llama, store, work / "first.json")
    prewarm = _finish(prewarming)
    chunks = _chunks(store)
    chunk_bytes = chunks[0].stat().st_size if chunks else 0
    prewarm_chunks = len(_chunks(prewarmed)) if prewarm.returncode == 0 else 0

    after_prewarm = Generating(max_python, tiny_llama, prewarmed, work / "after-prewarm.json") if prewarm_chunks else None
    second = _generate(max_python, tiny_llama, store, work / "second.json")
    _flip_payload_byte(chunks[len(chunks) // 2])
    corrupted = _serve_once(max_python, tiny_llama, store, work / "corrupted.json")
    after = after_prewarm.result() if after_prewarm is not None else Run("", 0, {}, 0.0)
    for chunk in _chunks(store):
        _zero_payload(chunk)
    zeroed = _generate(max_python, tiny_llama, store, work / "zeroed.json")
    for name, run in [("baseline", baseline), ("first", first), ("second", second), ("corrupted", corrupted),
                      ("zeroed", zeroed), ("after prewarm", after)]:
        print(f"max generate [{name}]: {run.seconds:.1f} s, text {run.text!r}, connector {run.stats}")
    return Session(baseline, first, second, corrupted, zeroed, len(chunks), chunk_bytes, prewarm, prewarm_chunks, after)


def test_first_run_offloads_the_prompts_full_blocks(session: Session):
    blocks = session.baseline.prompt_tokens // PAGE_TOKENS
    assert blocks >= 3
    s = session.first.stats
    assert s["blocks_written"] == blocks and s["blocks_read"] == 0 and s["offload_blocks_dropped"] == 0
    assert session.chunks_after_first == blocks
    assert s["bytes_written"] == blocks * (session.chunk_bytes - fmt.TRAILER_BYTES)
    assert session.first.text == session.baseline.text


def test_second_process_loads_the_prompt_from_the_store(session: Session):
    blocks = session.baseline.prompt_tokens // PAGE_TOKENS
    s = session.second.stats
    assert s["loads"] == 1 and s["blocks_read"] == blocks and s["load_failures"] == 0
    assert s["bytes_read"] == blocks * (session.chunk_bytes - fmt.TRAILER_BYTES)
    assert s["blocks_written"] == 0
    assert session.second.text == session.baseline.text


def test_corrupt_chunk_is_a_counted_failure_and_the_output_is_unchanged(session: Session):
    s = session.corrupted.stats
    assert s["load_failures"] == 1 and s["blocks_read"] == 0
    assert s["blocks_written"] == 1  # the quarantined block, recomputed, is stored again
    assert session.corrupted.text == session.baseline.text


def test_loaded_kv_is_what_the_model_reads(session: Session):
    blocks = session.baseline.prompt_tokens // PAGE_TOKENS
    assert session.zeroed.stats["blocks_read"] == blocks
    assert session.zeroed.text != session.baseline.text


def test_prewarm_with_max_then_a_new_process_loads_the_prompt(session: Session):
    """``gdskv prewarm --engine max`` writes the prompt's blocks and reports them (its engine's
    model worker, stopped with SIGTERM right after the prompt, writes what it was still
    writing); ``max generate`` in another process then reads them all and generates what plain
    MAX does."""
    assert session.prewarm.returncode == 0, session.prewarm.stderr[-4000:]
    blocks = session.baseline.prompt_tokens // PAGE_TOKENS
    assert session.prewarm_chunks == blocks
    assert json.loads(session.prewarm.stdout)["blocks_written"] == blocks
    run = session.after_prewarm
    assert run.stats["blocks_read"] == blocks and run.stats["blocks_written"] == 0
    assert run.text == session.baseline.text


def test_prewarm_with_weights_max_cannot_load_fails_in_one_line_instead_of_waiting(max_python: Path, tiny_llama: Path,
                                                                                  tmp_path: Path):
    """MAX 26.7's offline ``LLM`` waits with no timeout for its engine to say it is ready: with
    weights cut in half its engine ends instead, and ``gdskv prewarm --engine max`` used to wait
    forever. It now ends with the usage exit code and one line naming the engine's error."""
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_llama.iterdir():
        data = f.read_bytes()
        (model / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    run = _finish(_start_prewarm(max_python, model, tmp_path / "store", prompts), timeout=300)  # a MAX start: under a minute
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2, run.stderr[-4000:]
    assert last.startswith("Error: cannot start the max engine on the store") and "MAX's engine did not start" in last


def test_bench_ttft_measures_max_serving_a_prefix_from_the_store(max_python: Path, tmp_path: Path):
    """``scripts/bench_ttft.py --only max``: three ``max serve`` processes (computed, saving,
    served after the page cache was dropped) give the same text (the bench fails otherwise, and
    when the served server read no block) and a TTFT figure each. Which is faster is the bench's
    printed ratio, not this test's: a toy model of 2 layers computes 2k tokens in ~0.1 s, about
    what reading its prefix back from a cold disk takes."""
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_ttft.py"), "--dir", str(tmp_path), "--only", "max",
                          "--max-python", str(max_python), "--lengths", "256,2k", "--layers", "2", "--hidden", "128",
                          "--heads", "4", "--kv-heads", "2", "--intermediate", "256", "--json", str(out)],
                         capture_output=True, text=True, errors="replace", cwd=REPO, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "MAX (max serve on CPU" in run.stdout
    short, long = json.loads(out.read_text())["max"]
    assert short["prompt_tokens"] >= 256 and long["prompt_tokens"] >= 2048
    for row in (short, long):
        assert row["computed_s"] > 0 and row["served_cold_s"] > 0
        assert row["served_over_computed"] == pytest.approx(row["served_cold_s"] / row["computed_s"])
