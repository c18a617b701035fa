"""``gdskv prewarm``: unreadable prompt files are failed prompts, refused stores are one-line usage
errors; both through the real CLI (click's runner, or ``python -m gdskv.cli.main``)."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gdskv.cli.main import main
from gdskv.eviction import scan_store
from gdskv.store import PageStore

REPO = Path(__file__).resolve().parents[1]
# short prompts (a few dozen byte tokens: two or three 16-token blocks each) keep the reference engine quick
GOOD = ["The store keeps every block it has seen, so servers start warm.",
        "A second short prompt with different text, written as well."]


def cli(store: Path | str, *args: str) -> Any:
    """``gdskv --store STORE ARGS`` in this process; exceptions are reported, not raised."""
    return CliRunner().invoke(main, ["--store", str(store), *args])


def gdskv(store: Path | str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GDSKV_CONFIG", None)
    env.pop("GDSKV_STORE", None)
    return subprocess.run([sys.executable, "-m", "gdskv.cli.main", "--store", str(store), *args],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout)


def chunks_in(root: Path) -> int:
    return len(scan_store(PageStore.open(root, create=False), with_parents=False))


def good_txt(d: Path, name: str = "good.txt") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text("\n\n".join(GOOD) + "\n")
    return p


def no_traceback(res: Any) -> None:
    if isinstance(res, subprocess.CompletedProcess):
        assert "Traceback" not in res.stdout + res.stderr, res.stderr
    else:  # click's runner catches the exception a real run would print as a traceback
        assert "Traceback" not in res.output, res.output
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


# --- unreadable prompt files --------------------------------------------------------------------------
def test_binary_txt_is_one_failed_prompt_and_the_other_files_still_run(tmp_path: Path) -> None:
    good = good_txt(tmp_path / "p")
    bad = tmp_path / "p" / "binary.txt"
    bad.write_bytes(b"ok text\xff\xfe\x00\x01 then garbage\n\nmore")
    root = tmp_path / "store"
    res = cli(root, "prewarm", str(bad), str(good), "--json")
    no_traceback(res)
    assert res.exit_code == 1, res.output
    rep = json.loads(res.stdout)
    assert rep["prompts"] == 3 and rep["done"] == 2
    [failed] = rep["failed"]
    assert failed["source"] == str(bad)
    assert failed["error"] == "not UTF-8 text (byte 0xff at offset 7)"
    assert rep["blocks_written"] > 0 and chunks_in(root) == rep["blocks_written"]


def test_undecodable_jsonl_line_fails_alone_and_the_rest_of_the_file_runs(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    lines = [json.dumps({"prompt": GOOD[0]}).encode(), b'{"prompt": "caf\xe9 latin-1"}', json.dumps({"prompt": GOOD[1]}).encode()]
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    root = tmp_path / "store"
    res = cli(root, "prewarm", str(jsonl), "--json")
    no_traceback(res)
    assert res.exit_code == 1, res.output
    rep = json.loads(res.stdout)
    assert rep["prompts"] == 3 and rep["done"] == 2
    offset = len(lines[0]) + 1 + lines[1].index(b"\xe9")
    assert rep["failed"] == [{"source": f"{jsonl}:2", "error": f"not UTF-8 text (byte 0xe9 at offset {offset})"}]
    assert rep["blocks_written"] > 0 and chunks_in(root) == rep["blocks_written"]


def test_binary_jsonl_is_one_failed_prompt_not_one_per_line(tmp_path: Path) -> None:
    """A binary file (NUL bytes, not UTF-8) named .jsonl is one failure, not a flood of lines."""
    jsonl = tmp_path / "blob.jsonl"
    jsonl.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\n\n\xff\x00\n" * 20)
    good = good_txt(tmp_path)
    root = tmp_path / "store"
    res = cli(root, "prewarm", str(jsonl), str(good), "--json")
    no_traceback(res)
    assert res.exit_code == 1
    rep = json.loads(res.stdout)
    assert rep["done"] == 2 and rep["failed"] == [{"source": str(jsonl), "error": "not UTF-8 text (byte 0x89 at offset 0)"}]
    assert chunks_in(root) > 0


def test_directory_and_fifo_named_txt_are_failed_prompts_without_blocking(tmp_path: Path) -> None:
    d = tmp_path / "p"
    good_txt(d, "b.txt")
    (d / "a.txt").mkdir()
    os.mkfifo(d / "c.jsonl")
    fifo = tmp_path / "lone.txt"
    os.mkfifo(fifo)
    root = tmp_path / "store"
    # a subprocess with a timeout: a FIFO opened for reading would block with no writer
    p = gdskv(root, "prewarm", str(d), str(fifo), "--json", timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 1, p.stderr
    rep = json.loads(p.stdout)
    assert rep["done"] == 2
    assert rep["failed"] == [
        {"source": str(d / "a.txt"), "error": "not a regular file (a directory)"},
        {"source": str(d / "c.jsonl"), "error": "not a regular file (a FIFO)"},
        {"source": str(fifo), "error": "not a regular file (a FIFO)"},
    ]
    assert chunks_in(root) == rep["blocks_written"] > 0


def test_permission_denied_file_is_a_failed_prompt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = good_txt(tmp_path / "p", "secret.txt")
    secret.chmod(0)
    if os.geteuid() == 0:  # root reads files whatever their mode: refuse this one path as the kernel would
        real_open = os.open

        def guarded_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
            if Path(path) == secret:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", guarded_open)
    good = good_txt(tmp_path / "q")
    root = tmp_path / "store"
    try:
        res = cli(root, "prewarm", str(secret), str(good), "--json")
    finally:
        secret.chmod(0o600)
    no_traceback(res)
    assert res.exit_code == 1
    rep = json.loads(res.stdout)
    assert rep["done"] == 2 and rep["failed"] == [{"source": str(secret), "error": "cannot read: Permission denied"}]
    assert chunks_in(root) > 0


# --- refused stores -----------------------------------------------------------------------------------
def _one_line_refusal(res: Any, path: Path | str, why: str) -> None:
    no_traceback(res)
    code = res.returncode if isinstance(res, subprocess.CompletedProcess) else res.exit_code
    err = res.stderr.strip()
    assert code == 2, (code, res.stdout, err)
    assert len(err.splitlines()) == 1, err
    assert str(path) in err and why in err, err


def test_a_budget_smaller_than_the_prompts_is_reported_with_what_it_evicted(tmp_path: Path) -> None:
    """Warming more than ``max_bytes`` holds evicts the prompts warmed first: the summary says how
    many chunks went (the eviction journals' records), not only how many were written."""
    rng = random.Random(4)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
    prompts = tmp_path / "long.txt"
    prompts.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(400)) for _ in range(4)) + "\n")
    config = tmp_path / "gdskv.toml"
    config.write_text('[gdskv]\nmax_bytes = "2M"\n')
    env = dict(os.environ, OMP_NUM_THREADS="1", GDSKV_CONFIG=str(config))
    env.pop("GDSKV_STORE", None)
    store = tmp_path / "store"
    run = subprocess.run([sys.executable, "-m", "gdskv.cli.main", "--store", str(store), "prewarm", str(prompts)],
                         capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)
    assert run.returncode == 0, run.stderr
    no_traceback(run)
    assert re.search(r"capacity limits \(max_bytes 2\.0 MiB\) evicted \d+ chunks meanwhile", run.stdout), run.stdout
    again = subprocess.run([sys.executable, "-m", "gdskv.cli.main", "--store", str(store), "prewarm", "--json", str(prompts)],
                           capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)
    summary = json.loads(again.stdout)
    assert summary["evicted"] > 0 and summary["blocks_written"] > 0, summary
    unlimited = json.loads(gdskv(tmp_path / "other", "prewarm", "--json", str(prompts)).stdout)
    assert unlimited["evicted"] is None and unlimited["blocks_present"] == 0


def test_store_root_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    """``--store /``: a non-empty directory that is not a store, refused before any engine is built."""
    p = gdskv("/", "prewarm", str(good_txt(tmp_path)))
    _one_line_refusal(p, "/", "not a gdskv store")
    assert p.stdout == ""


def test_non_empty_directory_and_regular_file_are_refused_untouched(tmp_path: Path) -> None:
    txt = good_txt(tmp_path / "p")
    home = tmp_path / "home"  # like --store ~
    home.mkdir()
    (home / "notes.md").write_text("mine")
    res = cli(home, "prewarm", str(txt))
    _one_line_refusal(res, home, "not a gdskv store")
    assert sorted(x.name for x in home.iterdir()) == ["notes.md"]

    plain = tmp_path / "plain-file"
    plain.write_text("not a store")
    res = cli(plain, "prewarm", str(txt))
    _one_line_refusal(res, plain, "not a gdskv store")
    assert plain.read_text() == "not a store"


def _read_only_location(tmp_path: Path) -> Path:
    """A path where a store cannot be created: under a 0o555 directory, or (as root, who ignores
    modes) under /sys; skipped where neither refuses."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        (ro / "probe").mkdir()
    except OSError:
        return ro / "store"
    (ro / "probe").rmdir()
    try:
        os.mkdir("/sys/gdskv-prewarm-probe")
    except OSError:
        return Path("/sys/gdskv-prewarm-store")
    os.rmdir("/sys/gdskv-prewarm-probe")
    pytest.skip("no read-only location here")


def test_read_only_location_is_refused_in_one_line(tmp_path: Path) -> None:
    where = _read_only_location(tmp_path)
    try:
        res = cli(where, "prewarm", str(good_txt(tmp_path / "p")))
    finally:
        (tmp_path / "ro").chmod(0o755)
    _one_line_refusal(res, where, "gdskv store")
    assert any(why in res.stderr for why in ("Permission denied", "Operation not permitted", "Read-only file system")), res.stderr
    assert not where.exists()


def test_connector_setup_error_at_engine_bring_up_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gdskv.cli.prewarm import reference as mod
    from gdskv.connectors.trtllm import ConnectorSetupError

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise ConnectorSetupError("gdskv: store_path (GDSKV_STORE) x: refused for the test")

    monkeypatch.setattr(mod, "reference_stack", refuse)
    res = cli(tmp_path / "store", "prewarm", str(good_txt(tmp_path / "p")))
    _one_line_refusal(res, tmp_path / "store", "refused for the test")


def test_store_the_connector_cannot_use_is_not_a_silent_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker logs an OSError at registration and serves nothing: prewarm must not report
    its prompts done with nothing written (exit 0); it is a refused store (exit 2)."""
    def unwritable(*_a: Any, **_k: Any) -> Any:
        raise PermissionError(13, "Permission denied", "ns")

    monkeypatch.setattr(PageStore, "namespace", unwritable)
    res = cli(tmp_path / "store", "prewarm", str(good_txt(tmp_path / "p")), "--json")
    no_traceback(res)
    assert res.exit_code == 2, res.output
    assert "could not use the store" in res.stderr and res.stdout == ""


# --- --engine-arg ---------------------------------------------------------------------------------
def test_engine_args_become_the_engines_keyword_arguments() -> None:
    """JSON where it parses, Python's words, else the string; ``-`` in a key becomes ``_``."""
    from gdskv.cli.prewarm import parse_engine_args

    args = parse_engine_args("vllm", ["block-size=32", "enable_prefix_caching=false", "enforce_eager=True",
                                      "dtype=bfloat16", 'speculative_config={"n": 2}', "max_model_len=1024", "seed=None"])
    assert args == {"block_size": 32, "enable_prefix_caching": False, "enforce_eager": True, "dtype": "bfloat16",
                    "speculative_config": {"n": 2}, "max_model_len": 1024, "seed": None}
    assert parse_engine_args("max", ["kv_cache_page_size=128"]) == {"kv_cache_page_size": 128}
    assert parse_engine_args("reference", []) == {}


@pytest.mark.parametrize("engine, item, says", [
    ("reference", "block_size=32", "the reference engine takes none"),
    ("vllm", "block_size", "expected KEY=VALUE"),
    ("vllm", "=32", "expected KEY=VALUE"),
    ("vllm", "not a key=1", "expected KEY=VALUE"),
    ("vllm", "kv_transfer_config={}", "prewarm sets it itself"),
    ("max", "model-path=/x", "prewarm sets it itself"),
    ("trtllm", "kv_cache_config={}", "prewarm sets it itself"),
])
def test_a_bad_engine_arg_is_a_one_line_usage_error_before_any_store_is_made(tmp_path: Path, engine: str, item: str,
                                                                           says: str) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    model = [] if engine == "reference" else ["--model", "some/model"]
    res = cli(tmp_path / "store", "prewarm", str(prompts), "--engine", engine, *model, "--engine-arg", item)
    no_traceback(res)
    err = res.stderr.strip()
    assert res.exit_code == 2 and len(err.splitlines()) == 1 and says in err, (res.exit_code, err)
    assert not (tmp_path / "store").exists()


# --- --engine vllm --------------------------------------------------------------------------------
def test_vllm_engine_without_vllm_is_a_one_line_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where vLLM does not import, ``--engine vllm`` is exit 2 with one line naming what is missing
    (the real run is in docs/vllm.md: it needs a vLLM install)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    res = cli(tmp_path / "store", "prewarm", str(prompts), "--engine", "vllm", "--model", "some/model")
    no_traceback(res)
    err = res.stderr.strip()
    assert res.exit_code == 2, (res.exit_code, res.stdout, err)
    assert len(err.splitlines()) == 1 and "--engine vllm needs vLLM" in err, err


def test_vllm_engine_needs_a_model(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    res = cli(tmp_path / "store", "prewarm", str(prompts), "--engine", "vllm")
    assert res.exit_code == 2 and "--engine vllm needs --model" in res.stderr
