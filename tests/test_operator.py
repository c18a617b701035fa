"""Issue 15's findings, one test each, named after the finding: what a new operator hit running
the commands from cron, into logs and pipes, and against mistakes. Each checks the exit code
docs/cli.md promises (0 ok, 1 something failed, 2 unusable input), that an error is one line
(never a traceback), and what non-terminal output looks like.

Read-only stores are real read-only bind mounts (as root; skipped where mounting is refused).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from click.testing import CliRunner

from gdskv.cli.main import main
from gdskv.eviction import scan_store
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import PageTransfer

REPO = Path(__file__).resolve().parents[1]
TPB = 4
PAGE = 256


def fill(root: Path, chains: int = 3, blocks: int = 4, model: str = "test/operator-model-with-a-long-name") -> PageStore:
    store = PageStore.open(root)
    ns = store.namespace(NamespaceSpec(model, "uint8", TPB, (GroupSpec(0, PAGE, (0,)),)))
    engine = PosixEngine(threads=2)
    xfer = PageTransfer(ns, engine, threads=2)
    for c in range(chains):
        keys = chain_keys([c * 1000 + t for t in range(blocks * TPB)], TPB)
        for i, k in enumerate(keys):
            xfer.save_page(0, k, keys[i - 1] if i else None, [torch.full((PAGE,), i, dtype=torch.uint8)]).result()
    xfer.close()
    engine.close()
    return store


def cli(store: Path | str, *args: str) -> Any:
    return CliRunner().invoke(main, ["--store", str(store), *args])


def gdskv(store: Path | str, *args: str, timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GDSKV_CONFIG", "GDSKV_STORE", "COLUMNS", "LINES")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "gdskv.cli.main", "--store", str(store), *args],
                          capture_output=True, text=True, env=env, cwd=str(cwd), timeout=timeout)


def one_line_error(res: Any, code: int, *needles: str) -> None:
    """A subprocess's result, or click's runner's (whose exception a real run prints as a traceback)."""
    if not isinstance(res, subprocess.CompletedProcess):
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    rc = res.returncode if isinstance(res, subprocess.CompletedProcess) else res.exit_code
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    assert rc == code, (rc, res.stdout, res.stderr)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` bind-mounted read-only onto itself for the duration."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
        pytest.skip("mount --bind is refused here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True).returncode:
            pytest.skip("a read-only remount is refused here")
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True)  # a store object may hold its root open


def prompts(d: Path, text: str = "The store keeps every block it has seen, so servers start warm.\n") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "p.txt").write_text(text)
    return d / "p.txt"


# --- prewarm ---------------------------------------------------------------------------------------
def test_prewarm_into_a_file_or_a_read_only_store_is_exit_2_not_a_silent_success(tmp_path: Path) -> None:
    p = prompts(tmp_path / "p")
    plain = tmp_path / "a-file"
    plain.write_text("not a store")
    one_line_error(cli(plain, "prewarm", str(p)), 2, str(plain), "not a gdskv store")
    store = tmp_path / "store"
    fill(store)
    with read_only(store):
        res = cli(store, "prewarm", str(p))
    one_line_error(res, 2, str(store))
    assert "0 blocks written" not in res.stdout


def test_prewarm_into_a_non_store_directory_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    d = tmp_path / "home"
    d.mkdir()
    (d / "notes.md").write_text("mine")
    one_line_error(cli(d, "prewarm", str(prompts(tmp_path / "p"))), 2, "not a gdskv store")
    assert [x.name for x in d.iterdir()] == ["notes.md"]


def test_prewarm_non_utf8_prompt_files_are_listed_and_skipped(tmp_path: Path) -> None:
    d = tmp_path / "p"
    prompts(d)
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (d / "bad.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    res = cli(tmp_path / "store", "prewarm", str(d), "--json")
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["done"] == 1 and out["prompts"] == 3
    assert {Path(f["source"].split(":")[0]).name for f in out["failed"]} == {"latin1.txt", "bad.jsonl"}
    assert all("not UTF-8" in f["error"] for f in out["failed"])


def test_prewarm_empty_prompt_file_is_listed_and_counted(tmp_path: Path) -> None:
    d = tmp_path / "p"
    prompts(d)
    (d / "empty.txt").write_text("")
    (d / "blank.jsonl").write_text("\n\n")
    res = cli(tmp_path / "store", "prewarm", str(d), "--json")
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["prompts"] == 3 and out["done"] == 1
    assert sorted(Path(f["source"]).name for f in out["failed"]) == ["blank.jsonl", "empty.txt"]
    assert all("empty file" in f["error"] for f in out["failed"])


def test_prewarm_empty_messages_list_is_a_failed_prompt_not_done(tmp_path: Path) -> None:
    d = tmp_path / "p"
    d.mkdir()
    (d / "chat.jsonl").write_text(json.dumps({"messages": []}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi there store"}]}) + "\n")
    res = cli(tmp_path / "store", "prewarm", str(d), "--json")
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["done"] == 1 and [f["source"].rsplit(":", 1)[1] for f in out["failed"]] == ["1"]
    assert "non-empty list of 'messages'" in out["failed"][0]["error"]


def test_prewarm_of_a_long_prompt_reports_progress_within_seconds(tmp_path: Path) -> None:
    """Off a terminal (a log), a status line every --status-every seconds names the blocks the
    running prompt has stored so far, well before the prompt ends."""
    words = " ".join(f"w{i}" for i in range(330))  # ~1600 byte tokens, ~100 blocks
    p = prompts(tmp_path / "p", words + "\n")
    res = CliRunner().invoke(main, ["--store", str(tmp_path / "store"), "--status-every", "0.05", "prewarm", str(p), "--max-prompt-tokens", "2000"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("prewarm: 0/1 prompts")]
    assert lines, res.stderr
    within = [int(m.group(1)) for ln in lines if (m := re.search(r": (\d+) of \d+ blocks stored so far", ln))]
    assert within and max(within) > 0, lines  # progress inside the one prompt
    assert "\x1b[" not in res.stderr  # no terminal control codes in a log


# --- evict -----------------------------------------------------------------------------------------
def test_evict_on_a_read_only_store_says_removed_0_and_why(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store)
    chunks = len(scan_store(PageStore.open(store, create=False), with_parents=False))
    with read_only(store):
        res = cli(store, "evict", "--max-bytes", "0")
        js = cli(store, "evict", "--max-bytes", "0", "--json")
    assert res.exit_code == 1 and js.exit_code == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    line = res.stdout.strip().splitlines()[-1]
    assert line.startswith(f"removed 0 of {chunks} chunks"), line
    assert f"{chunks} failed: Read-only file system" in line, line
    rep = json.loads(js.stdout)
    assert rep["removed"] == 0 and rep["failed"] == chunks and rep["failure_reasons"] == {"Read-only file system": chunks}


def test_gc_on_a_read_only_store_says_removed_0_and_why(tmp_path: Path) -> None:
    """Same finding as evict's, for gc: a leftover temp file that cannot be removed is counted
    with its reason and the exit is 1, not "removed 0 temp files" and 0."""
    store = fill(tmp_path / "store")
    [array] = store.arrays()
    chunk = Path(next(e for e in store.chunk_entries(array) if e.is_chunk).path)
    leftover = chunk.with_name(chunk.name + ".tmp.999999999.1")  # no such pid
    leftover.write_bytes(b"half a chunk")
    with read_only(tmp_path / "store"):
        res = cli(tmp_path / "store", "gc", "--grace", "0s", "--min-age", "0s")
        js = cli(tmp_path / "store", "gc", "--grace", "0s", "--min-age", "0s", "--json")
    assert res.exit_code == 1 and js.exit_code == 1, res.output
    assert "removed 0 of 1 temp files" in res.stdout and "1 failed: Read-only file system" in res.stdout, res.stdout
    assert json.loads(js.stdout)["failure_reasons"] == {"Read-only file system": 1}
    assert leftover.exists()


# --- demo ------------------------------------------------------------------------------------------
def test_demo_on_a_non_store_directory_a_file_or_a_read_only_store_is_one_line(tmp_path: Path) -> None:
    d = tmp_path / "home"
    d.mkdir()
    (d / "notes.md").write_text("mine")
    one_line_error(cli(d, "demo"), 2, "not a gdskv store")
    plain = tmp_path / "a-file"
    plain.write_text("x")
    one_line_error(cli(plain, "demo"), 2, "not a gdskv store")
    store = tmp_path / "store"
    fill(store)
    with read_only(store):
        one_line_error(cli(store, "demo"), 2, str(store))


# --- verify ----------------------------------------------------------------------------------------
def test_verify_reports_a_foreign_file_in_a_chunk_directory_as_foreign_and_leaves_it(tmp_path: Path) -> None:
    store = fill(tmp_path / "store")
    [array] = store.arrays()
    entry = next(e for e in store.chunk_entries(array) if e.is_chunk)
    foreign = Path(entry.path).parent / "notes.txt"
    foreign.write_text("an operator's note, not a chunk")
    res = cli(tmp_path / "store", "verify", "--repair", "--json")
    rep = json.loads(res.stdout)
    assert res.exit_code == 0, res.output  # every chunk is sound
    assert rep["bad"] == 0 and rep["reasons"] == {}
    assert [Path(f["path"]).name for f in rep["foreign"]] == ["notes.txt"]
    assert foreign.read_text() == "an operator's note, not a chunk"
    text = cli(tmp_path / "store", "verify", "--repair")
    assert "1 foreign file left alone" in text.stdout, text.stdout


def test_verify_reports_a_chunk_directory_linked_elsewhere_and_leaves_it(tmp_path: Path) -> None:
    """A chunk directory replaced by a link (say, to spread chunks over another disk) is never
    entered, and used to be skipped without a word: its chunks were simply not there."""
    store = fill(tmp_path / "store")
    [array] = store.arrays()
    entry = next(e for e in store.chunk_entries(array) if e.is_chunk)
    hi_dir = Path(entry.path).parent.parent
    elsewhere = tmp_path / "elsewhere"
    hi_dir.rename(elsewhere)
    hi_dir.symlink_to(elsewhere)
    res = cli(tmp_path / "store", "verify", "--repair", "--json")
    assert res.exit_code == 0, res.output
    assert [f["path"] for f in json.loads(res.stdout)["foreign"]] == [str(hi_dir)]
    assert hi_dir.is_symlink() and Path(entry.path).name in [p.name for p in (elsewhere / "0").iterdir()]
    assert "1 foreign file left alone" in cli(tmp_path / "store", "verify").stdout


@pytest.mark.parametrize("level", ["namespace", "group"])
def test_verify_reports_a_namespace_or_group_directory_linked_elsewhere_and_leaves_it(tmp_path: Path, level: str) -> None:
    """A namespace (or layer-group) directory replaced by a link is never entered, and was
    skipped without a word, as chunk directories were before."""
    store = fill(tmp_path / "store")
    [array] = store.arrays()
    linked = Path(array.path) if level == "group" else Path(array.path).parent
    elsewhere = tmp_path / "elsewhere"
    linked.rename(elsewhere)
    linked.symlink_to(elsewhere)
    before = sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*"))
    res = cli(tmp_path / "store", "verify", "--repair", "--json")
    assert res.exit_code == 0, res.output
    assert [f["path"] for f in json.loads(res.stdout)["foreign"]] == [str(linked)]
    assert linked.is_symlink() and sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*")) == before
    assert "1 foreign file left alone" in cli(tmp_path / "store", "verify").stdout


# --- output that is not a terminal -------------------------------------------------------------------
def test_non_terminal_output_tables_are_full_width_not_80_columns(tmp_path: Path) -> None:
    fill(tmp_path / "store", model="organisation/a-model-name-long-enough-to-be-cut-at-eighty-columns-in-a-table")
    res = cli(tmp_path / "store", "info")  # click's runner: stdout is not a terminal
    assert res.exit_code == 0, res.output
    assert "organisation/a-model-name-long-enough-to-be-cut-at-eighty-columns-in-a-table" in res.stdout, res.stdout
    assert "…" not in res.stdout
    assert "\x1b[" not in res.stdout


# --- stats -----------------------------------------------------------------------------------------
def test_stats_shows_lookups_after_a_short_run(tmp_path: Path) -> None:
    """A short run: a serving process whose last lookups came after its last flush (and that never reached
    close(): a server stopped, a short script) still leaves them in the store's counters."""
    script = ("import sys\n"
              "from gdskv.config import GdsKvConfig\n"
              "from gdskv.service import KvService\n"
              "from gdskv.store import GroupSpec, NamespaceSpec\n"
              "svc = KvService(GdsKvConfig(store_path=sys.argv[1]), NamespaceSpec('m', 'uint8', 4, (GroupSpec(0, 256, (0,)),)), transfers=False)\n"
              "svc.lookup(list(range(64)), None)\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    res = cli(tmp_path / "store", "stats", "--json")
    assert res.exit_code == 0, res.output
    [counters] = json.loads(res.stdout)["namespaces"].values()
    assert counters["lookups"] == 1 and counters["lookup_tokens"] == 64, counters


# --- help and docs -----------------------------------------------------------------------------------
def test_gdskv_max_help_without_max_is_one_line_not_a_traceback() -> None:
    import importlib.util

    if importlib.util.find_spec("max") is not None:
        pytest.skip("MAX is installed here")
    script = Path(sys.executable).parent / "gdskv-max"
    res = subprocess.run([str(script) if script.exists() else sys.executable, *([] if script.exists() else ["-m", "gdskv.connectors.max.launch"]), "--help"],
                         capture_output=True, text=True, timeout=60)
    one_line_error(res, 2, "MAX is not installed")


def test_bench_help_lists_json_and_the_store_directory_as_default() -> None:
    res = CliRunner().invoke(main, ["bench", "--help"])
    assert res.exit_code == 0
    assert "--json" in res.output and "--dir" in res.output
    assert "directory that holds the store" in " ".join(res.output.split())
    assert "temp directory" not in res.output
    inner = CliRunner().invoke(main, ["bench", "--", "--help"])  # the benchmark's own options
    assert inner.exit_code == 0 and "under gdskv bench: the directory that holds the store" in " ".join(inner.output.split())


def test_docs_max_cites_no_file_missing_from_the_repository() -> None:
    text = (REPO / "docs" / "max.md").read_text()
    for path in re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:md|py|toml|yaml|json))`", text):
        assert (REPO / path).exists(), path


def test_docs_max_venv_recipe_does_not_use_system_site_packages() -> None:
    from test_docs import fenced_lines

    lines = [line for _, line in fenced_lines(REPO / "docs" / "max.md")]
    assert any(line.startswith("python3 -m venv") for line in lines)
    assert not any("--system-site-packages" in line for line in lines)


def test_format_md_names_temp_files_as_the_code_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temp name FORMAT.md gives a chunk being published is the one a real save uses."""
    doc = (REPO / "FORMAT.md").read_text()
    pattern = re.search(r"write `payload \|\| trailer` to `([^`]+)`", doc).group(1)
    renames: list[tuple[str, str]] = []
    real = os.rename

    def spy(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        renames.append((str(src), str(dst)))
        real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", spy)
    from gdskv.io import batch as batchio

    real_batch = batchio.write_chunks

    def batch_spy(root_fd: int, jobs: Any, *a: Any, **k: Any) -> list[int]:  # the native path renames in C
        renames.extend((tmp, name) for _, tmp, name, _ in jobs)
        return real_batch(root_fd, jobs, *a, **k)

    real_later = batchio.write_later

    def later_spy(queue: Any, root_fd: int, jobs: Any, *a: Any, **k: Any) -> None:  # saves finished by reap
        renames.extend((job[1], job[2]) for job in jobs)
        real_later(queue, root_fd, jobs, *a, **k)

    monkeypatch.setattr(batchio, "write_chunks", batch_spy)
    monkeypatch.setattr(batchio, "write_later", later_spy)
    fill(tmp_path / "store", chains=1, blocks=1)
    monkeypatch.undo()
    tmp, name = next((s, d) for s, d in renames if ".tmp." in s and d.isdigit())
    regex = re.escape(pattern).replace(re.escape("<lo>"), re.escape(name)).replace(re.escape("<pid>"), str(os.getpid()))
    regex = regex.replace(re.escape("<n>"), "[0-9a-f]+")
    assert re.fullmatch(regex, tmp), (pattern, tmp)


def test_top_level_config_keys_without_a_gdskv_table_are_used_not_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file for gdskv alone may hold its settings at the top level: they apply (an unknown one
    is an error naming it); beside a [gdskv] table they are an error naming them."""
    from gdskv.config import ConfigError, load_config

    monkeypatch.delenv("GDSKV_STORE", raising=False)
    f = tmp_path / "gdskv.toml"
    f.write_text(f'store_path = "{tmp_path / "s"}"\nio_threads = 3\n')
    cfg = load_config(str(f))
    assert cfg.io_threads == 3 and cfg.store_path == str(tmp_path / "s")
    f.write_text('io_threads = 3\nstore = "x"\n')
    with pytest.raises(ConfigError, match="unknown setting 'store'"):
        load_config(str(f))
    f.write_text('io_threads = 3\n[gdskv]\nengine = "posix"\n')
    with pytest.raises(ConfigError, match="'io_threads' stands at the top level"):
        load_config(str(f))


# --- every command ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["info", "ls", "stats", "verify", "evict", "gc", "prewarm", "bench", "demo"])
def test_every_command_takes_json_and_lists_it_in_its_help(command: str) -> None:
    res = CliRunner().invoke(main, [command, "--help"])
    assert res.exit_code == 0 and "--json" in res.output, res.output


def test_an_unexpected_error_is_one_line_and_exit_1_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a command did not turn into a usage error (here a bug, simulated) is still one
    line on stderr, exit 1."""
    from gdskv.cli import info as info_mod

    def broken(_ctx: Any) -> Any:
        raise RuntimeError("something\nbroke")

    fill(tmp_path / "store")
    monkeypatch.setattr(info_mod, "gather", broken)
    res = cli(tmp_path / "store", "info")
    one_line_error(res, 1, "info: RuntimeError: something broke")


def test_bench_plot_without_matplotlib_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError, installed or not
    res = CliRunner().invoke(main, ["bench", "--plot", "out.png", "--total", "1M"])
    one_line_error(res, 2, "--plot needs matplotlib", "gdskv[plot]")


def test_progress_off_a_terminal_is_a_periodic_status_line(capsys: pytest.CaptureFixture[str]) -> None:
    import time

    from gdskv.cli.progress import Work

    with Work("verify", 10, "chunks", every=0.05, detail=lambda: "group 0") as work:
        for _ in range(4):
            work.advance()
            time.sleep(0.06)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2, lines
    assert re.fullmatch(r"verify: \d+/10 chunks \(\d+%\), [\d.]+ chunks/s, \dm\d\ds left, 0m00s so far; group 0", lines[-1]), lines


def test_progress_bar_on_a_terminal_shows_a_prompt_path_as_it_is(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt file under a directory named ``k[`` is ``k[/x]/p.txt``: on a terminal, rich took it
    for a closing tag, and the bar's refresh thread failed with a traceback (prewarm too, exit 1)."""
    import time

    from gdskv.cli.progress import Work

    monkeypatch.setenv("FORCE_COLOR", "1")  # rich takes stderr for a terminal: the bar, not status lines
    with Work("prewarm", 2, "prompts", every=0.05, detail=lambda: "k[/x]/p.txt#1 \x1b[31m") as work:
        time.sleep(0.6)
        work.advance()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "k[/x]/p.txt#1 \\x1b[31m" in err, err


# --- plots -----------------------------------------------------------------------------------------
def test_stats_plot_draws_hit_rate_and_bytes_over_time(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gdskv.config import GdsKvConfig
    from gdskv.service import KvService

    store = fill(tmp_path / "store")  # process 1 (a store object of its own): saves
    store.flush_stats()
    [ns] = store.namespaces()
    for _ in range(2):  # processes 2 and 3: a lookup each, served from what process 1 saved
        svc = KvService(GdsKvConfig(store_path=str(tmp_path / "store")), ns.spec, transfers=False)
        svc.lookup(list(range(4 * TPB)), None)
        svc.close()
    out = tmp_path / "stats.png"
    res = cli(tmp_path / "store", "stats", "--plot", str(out))
    assert res.exit_code == 0, res.output
    assert "plot of 3 points (3 process files)" in res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_plot_without_matplotlib_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(tmp_path / "store")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    one_line_error(cli(tmp_path / "store", "stats", "--plot", str(tmp_path / "o.png")), 2, "--plot needs matplotlib")
    assert not (tmp_path / "o.png").exists()
