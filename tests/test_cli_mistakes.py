"""Mistakes and damage the CLI answers in one line with the documented exit code (0 ok, 1 something
failed, 2 unusable input), creating nothing on a usage error: regression tests for what a review
of every command found, on real stores, some in subprocesses without the permission to read."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gdskv.cli.main import main
from gdskv.store import PageStore
from test_cli import _chains, build_store


def run(*args: str) -> Result:
    res = CliRunner().invoke(main, list(args))
    assert "Traceback" not in res.output and (res.exception is None or isinstance(res.exception, SystemExit)), res.output
    return res


def one_line_error(res: Result, code: int) -> str:
    assert res.exit_code == code, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error"), res.output
    return lines[0]


def unprivileged(*args: str) -> subprocess.CompletedProcess:
    """``gdskv ARGS`` in a subprocess that file permissions bind: as root, without the capabilities
    that override them (setpriv); skipped where that cannot be arranged."""
    cmd = [sys.executable, "-m", "gdskv.cli.main", *args]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: permissions cannot be made to bind")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps=-all", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    build_store(root, _chains(2, 3))
    return root


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "0"])
def test_status_every_must_be_a_finite_number_of_seconds(store, value):
    assert "--status-every" in one_line_error(run("--status-every", value, "--store", str(store), "verify"), 2)


def test_ls_limit_is_refused_below_zero(store):
    assert "--limit" in one_line_error(run("--store", str(store), "ls", "--limit", "-1"), 2)


def test_an_error_naming_a_path_with_control_characters_stays_one_line(tmp_path):
    line = one_line_error(run("--store", str(tmp_path / "a\nb\x1b[31m"), "info"), 2)
    assert "a\\nb\\x1b[31m" in line


@pytest.mark.parametrize("damage, says", [
    ("garbage", "does not parse"),
    ("directory", "could not be read: not a regular file"),
])
def test_a_damaged_root_zarr_json_is_named_as_what_it_is(store, damage, says):
    meta = store / "zarr.json"
    meta.unlink()
    if damage == "garbage":
        meta.write_text('{"broken')
    else:
        meta.mkdir()
    assert says in one_line_error(run("--store", str(store), "info"), 2)


def test_a_store_without_permission_to_read_it_is_exit_1(store):
    os.chmod(store, 0)
    try:
        res = unprivileged("--store", str(store), "info")
    finally:
        os.chmod(store, 0o700)
    assert res.returncode == 1 and res.stderr.strip().splitlines() == [f"Error: {store} could not be read: Permission denied"]


def test_verify_reports_an_unreadable_chunk_and_checks_the_rest(store):
    ns = PageStore.open(store, create=False)
    chunks = sorted(e.path for _, _, e in ns.iter_chunk_files())
    os.chmod(chunks[0], 0)
    res = unprivileged("--store", str(store), "verify", "--json")
    rep = json.loads(res.stdout)
    assert res.returncode == 1, res.stderr
    assert rep["reasons"] == {"unreadable": 1} and rep["ok"] == len(chunks) - 1


@pytest.mark.parametrize("content", [
    '{"namespaces": {"x": {"loads_hit": 1e400}}}',
    '{"namespaces": {}, "updated": "abc"}',
])
def test_stats_skips_a_malformed_counter_file_on_stderr(store, content):
    (store / ".gdskv" / "stats").mkdir(parents=True, exist_ok=True)
    (store / ".gdskv" / "stats" / "bad.json").write_text(content)
    res = CliRunner().invoke(main, ["--store", str(store), "stats", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["unreadable"] == ["bad.json"], res.output
    res = CliRunner().invoke(main, ["--store", str(store), "stats"])
    assert res.exit_code == 0 and "bad.json" in res.stderr and "bad.json" not in res.stdout


def test_prewarm_into_a_store_it_cannot_write_fails_the_prompt(store, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("a prompt long enough to fill several blocks of the reference engine " * 4)
    unreadable = tmp_path / "unreadable.txt"
    unreadable.write_text("never read")
    os.chmod(unreadable, 0)
    first = tmp_path / "first.txt"
    first.write_text("another prompt, which makes the reference engine's namespace " * 2)
    assert run("--store", str(store), "prewarm", str(first)).exit_code == 0
    for d in [store / "ns", *(p for p in (store / "ns").rglob("*") if p.is_dir())]:
        os.chmod(d, 0o500)
    try:
        res = unprivileged("--store", str(store), "prewarm", "--json", str(prompt), str(unreadable))
    finally:
        for d in [store / "ns", *(p for p in (store / "ns").rglob("*") if p.is_dir())]:
            os.chmod(d, 0o700)
    assert res.returncode == 1, res.stderr
    failed = {f["source"]: f["error"] for f in json.loads(res.stdout)["failed"]}
    assert failed[str(unreadable)] == "cannot read: Permission denied"
    assert "could not be saved" in failed[f"{prompt}#1"]


@pytest.mark.parametrize("engine, module", [("vllm", "vllm"), ("trtllm", "tensorrt_llm"), ("max", "max")])
def test_prewarm_with_an_engine_not_installed_creates_no_store(tmp_path, engine, module):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    root = tmp_path / "new-store"
    assert "needs" in one_line_error(run("--store", str(root), "prewarm", str(prompt), "--engine", engine, "--model", "m"), 2)
    assert not root.exists()


def test_pull_without_a_remote_creates_no_store(tmp_path, monkeypatch):
    monkeypatch.delenv("GDSKV_CONFIG", raising=False)
    root = tmp_path / "new-store"
    assert "[gdskv.remote]" in one_line_error(run("--store", str(root), "pull"), 2)
    assert not root.exists()


@pytest.mark.parametrize("args, says", [
    (["--engines", "bogus"], "--engines"),
    (["--engines", ","], "--engines"),
    (["--total", "99999999999999999999G"], "--total"),
])
def test_bench_refuses_unknown_engines_and_totals_beyond_memory(store, args, says):
    res = CliRunner().invoke(main, ["--store", str(store), "bench", *args])
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.parametrize("args, says", [
    (["--page-bytes", "99999999999999999999"], "--page-bytes"),
    (["--pages-per-prompt", "100000"], "--pages-per-prompt"),
])
def test_demo_refuses_pages_beyond_its_bounds_before_touching_the_store(tmp_path, args, says):
    root = tmp_path / "new-store"
    assert says in one_line_error(run("--store", str(root), "demo", *args), 2)
    assert not root.exists()


def test_prewarm_refuses_a_prompt_limit_beyond_the_reference_pool(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    assert "--max-prompt-tokens" in one_line_error(run("prewarm", str(prompt), "--max-prompt-tokens", str(10**23)), 2)


@pytest.mark.parametrize("spelling", ["relative", "dotdot"])
def test_verify_checks_every_chunk_of_a_store_named_by_a_relative_or_unnormalized_path(store, tmp_path, monkeypatch, spelling):
    ns = PageStore.open(store, create=False)
    chunks = sorted(e.path for _, _, e in ns.iter_chunk_files())
    with open(chunks[0], "r+b") as f:
        f.write(b"\xff" * 8)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    path = "store" if spelling == "relative" else str(tmp_path / "elsewhere" / ".." / "store")
    res = run("--store", path, "verify", "--json")
    rep = json.loads(res.stdout)
    assert res.exit_code == 1, res.output
    assert (rep["ok"], rep["bad"], rep["gone"]) == (len(chunks) - 1, 1, 0), rep
    assert rep["reasons"] == {"bad-checksum": 1}


@pytest.mark.parametrize("args", [
    ["ls", "--older-than", "9" * 400 + "w"],
    ["evict", "--dry-run", "--older-than", "9" * 400 + "d"],
    ["gc", "--dry-run", "--grace", "9" * 400],
])
def test_a_duration_too_long_to_be_a_number_is_a_usage_error(store, args):
    line = one_line_error(run("--store", str(store), *args), 2)
    assert "duration" in line and "Overflow" not in line


DEEP_JSON = "[" * 100_000


def test_a_root_zarr_json_nested_past_the_parser_does_not_parse(store):
    (store / "zarr.json").write_text(DEEP_JSON)
    assert "does not parse" in one_line_error(run("--store", str(store), "info"), 2)


def test_a_namespace_zarr_json_nested_past_the_parser_is_a_damaged_namespace(store):
    ns_dir = next((store / "ns").iterdir())
    (ns_dir / "zarr.json").write_text(DEEP_JSON)
    res = run("--store", str(store), "info", "--json")
    assert res.exit_code == 0, res.output
    damaged = [ns for ns in json.loads(res.stdout)["namespaces"] if ns.get("damaged")]
    assert [ns["id"] for ns in damaged] == [ns_dir.name] and "nested too deeply" in damaged[0]["damaged"]
    assert run("--store", str(store), "verify").exit_code == 1


def test_stats_skips_a_counter_file_nested_past_the_parser(store):
    (store / ".gdskv" / "stats").mkdir(parents=True, exist_ok=True)
    (store / ".gdskv" / "stats" / "deep.json").write_text(DEEP_JSON)
    res = run("--store", str(store), "stats", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["unreadable"] == ["deep.json"], res.output


def test_prewarm_fails_only_the_jsonl_line_nested_past_the_parser(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(DEEP_JSON + "\n" + json.dumps({"prompt": "a prompt that is warmed all the same"}) + "\n")
    res = run("--store", str(tmp_path / "new-store"), "prewarm", "--json", str(prompts))
    assert res.exit_code == 1, res.output
    rep = json.loads(res.stdout)
    assert rep["done"] == 1 and [f["source"] for f in rep["failed"]] == [f"{prompts}:1"], rep


def test_a_config_nested_past_the_toml_parser_is_named(store, tmp_path, monkeypatch):
    cfg = tmp_path / "deep.toml"
    cfg.write_text("a = " + "[" * 100_000)
    monkeypatch.setenv("GDSKV_CONFIG", str(cfg))
    assert f"{cfg} is not valid TOML" in one_line_error(run("--store", str(store), "info"), 2)


def test_reports_show_paths_as_they_are_never_as_markup_or_terminal_codes(tmp_path):
    root = tmp_path / "k[" / "x][red]"
    root.parent.mkdir()
    build_store(root, _chains(2, 3))
    chunk = min(e.path for _, _, e in PageStore.open(root, create=False).iter_chunk_files())
    for name in ("[bold]notes", "esc\x1b[31mred"):
        Path(chunk).with_name(name).write_text("not gdskv's")
    info = run("--store", str(root), "info")
    assert info.exit_code == 0 and f"store   {root}  " in info.stdout, info.output
    evict = run("--store", str(root), "evict", "--dry-run", "--max-bytes", "0")
    assert evict.exit_code == 0 and chunk in evict.stdout, evict.output
    verify = run("--store", str(root), "verify")
    assert verify.exit_code == 0, verify.output
    assert "[bold]notes" in verify.stdout and "esc\\x1b[31mred" in verify.stdout and "\x1b" not in verify.stdout


def test_prewarm_into_a_store_it_may_not_write_says_it_is_a_store(store, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    os.chmod(store, 0o500)
    try:
        res = unprivileged("--store", str(store), "prewarm", str(prompt))
    finally:
        os.chmod(store, 0o700)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"Error: {store} is a gdskv store this process cannot write (Permission denied); refusing to use it. "
        "Pass --store PATH or set GDSKV_STORE."], res.stderr


@pytest.mark.parametrize("command", ["info", "verify", "gc"])
def test_a_store_path_with_a_name_too_long_is_refused_as_a_usage_error(tmp_path, command):
    root = tmp_path / ("a" * 300)
    line = one_line_error(run("--store", str(root), command), 2)
    assert "is not a gdskv store (File name too long)" in line and not os.path.lexists(root)


def test_evict_on_a_store_whose_index_it_may_not_write_says_so_once(store):
    index = store / ".gdskv" / "index"
    shutil.rmtree(index, ignore_errors=True)
    index.mkdir(parents=True)
    os.chmod(index, 0o500)
    try:
        res = unprivileged("--store", str(store), "evict", "--dry-run", "--max-bytes", "0")
    finally:
        os.chmod(index, 0o700)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().splitlines() == [
        "evict: the eviction index could not be saved (Permission denied); the next run reads every chunk's parent again"], res.stderr
