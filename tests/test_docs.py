"""The docs run: every command line in README.md and docs/*.md, as written, so they cannot drift.

Lines of fenced ``sh``/``bash`` blocks are run or checked by what they start with:

- ``gdskv ...``: run for real (``gdskv --store <a store built here>``, in a directory holding a
  ``prompts/``); only ``gdskv demo`` and ``--remote`` lines are checked by parsing (their ``--help``:
  their real runs are tests/test_demo.py and tests/test_remote_cli.py, against moto's S3 server);
- ``cat > FILE.toml <<'EOF'`` here-documents: the body loads as a gdskv config; ``minio``, ``mc``,
  ``aws`` (making a bucket) and ``export AWS_...``: the tool and subcommand, the variable names;
- ``python -m gdskv.connectors.max_launch ...`` / ``gdskv-max ...``: run as written; without MAX
  installed (here) the documented answer is one line and exit 2;
- lines that need the network or an engine server (``pip install``, ``python3 -m venv``,
  ``trtllm-serve``, vLLM's ``api_server``, ``python -m pytest -m max``) are checked by parsing:
  the pins are the ones the tests install, the extras and markers exist, the config files and
  connector classes they name exist, their JSON parses;
- ``export GDSKV_...``: a variable gdskv reads; ``gdskv ... > FILE && mv FILE ...`` (cron): the
  command runs and its output is checked (``--prometheus``: parsed by prometheus_client), the
  ``mv`` parsed.

A line no rule knows fails the test (add a rule rather than let it go unchecked). Every
backticked ``gdskv <command> [options]`` in the prose (the table of docs/cli.md) is checked
against the command's ``--help``: the command exists and takes every option named.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from gdskv.cli.main import main
from gdskv.config import load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def fenced_lines(path: Path) -> list[tuple[str, str]]:
    """``(where, line)`` for each command of the shell blocks: continuations and quotes that span
    lines joined; comment-only and blank lines dropped."""
    out, lang, buf, start = [], None, "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", raw)
        if fence:
            lang = None if lang is not None else fence.group(1)
            continue
        if lang not in ("sh", "bash", "shell", "console"):
            continue
        if not buf:
            start = n
        buf = f"{buf}\n{raw}" if buf else raw
        heredoc = re.search(r"<<'?(\w+)'?\s*$", buf.split("\n")[0])
        if heredoc and raw != heredoc.group(1):  # a here-document: its body up to the end word
            continue
        if heredoc:
            out.append((f"{path.name}:{start}", buf))
            buf = ""
            continue
        if buf.endswith("\\"):
            buf = buf[:-1]
            continue
        try:
            words = shlex.split(buf, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        if words:
            out.append((f"{path.name}:{start}", buf))
        buf = ""
    return out


def inline_gdskv(path: Path) -> list[tuple[str, str]]:
    """Backticked ``gdskv <command> ...`` spans in the prose."""
    text = path.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [(path.name, m.group(1)) for m in re.finditer(r"`(gdskv [a-z][^`]*)`", text)]


ALL_FENCED = [item for doc in DOCS for item in fenced_lines(doc)]
ALL_INLINE = [item for doc in DOCS for item in inline_gdskv(doc)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``prompts/`` (what README's prewarm line reads) and a store filled by it."""
    d = tmp_path_factory.mktemp("docs")
    (d / "prompts").mkdir()
    (d / "prompts" / "a.txt").write_text("The store keeps every block it has seen.\n\nA second short prompt, written too.\n")
    (d / "prompts" / "b.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hello there, store"}]}) + "\n")
    res = CliRunner().invoke(main, ["--store", str(d / "store"), "prewarm", str(d / "prompts")])  # any line may run first
    assert res.exit_code == 0, res.output
    return d


def _gdskv(workspace: Path, args: list[str]) -> None:
    redirected = ">" in args  # `gdskv stats --prometheus > FILE`: the output is checked, not written there
    args = args[:args.index(">")] if redirected else args
    if args[:1] == ["demo"]:  # the end-to-end run is tests/test_demo.py
        res = CliRunner().invoke(main, ["demo", "--help"])
        assert res.exit_code == 0, res.output
        return
    if "--remote" in args:  # needs a bucket: run for real against moto's S3 server in tests/test_remote_cli.py
        res = CliRunner().invoke(main, [args[0], "--help"])
        assert res.exit_code == 0 and "--remote" in res.output, res.output
        return
    cwd = os.getcwd()
    os.chdir(workspace)
    try:
        res = CliRunner().invoke(main, ["--store", str(workspace / "store"), *args], catch_exceptions=False)
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, (args, res.output)
    if "--prometheus" in args:
        from prometheus_client.parser import text_string_to_metric_families

        assert any(f.name == "gdskv_lookups" for f in text_string_to_metric_families(res.stdout)), res.stdout


def _pip_install(args: list[str]) -> None:
    from engine_venv import TORCH_REQUIREMENT  # the pin the engine virtualenvs install

    for a in args[2:]:
        if a.startswith("torch"):
            assert a == TORCH_REQUIREMENT, a
        elif a.startswith(".[") or a.startswith('".['):
            extras = a.strip('"').removeprefix(".[").removesuffix("]").split(",")
            assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"]), extras
        elif a.startswith("max[serve]"):
            assert a in (REPO / "tests" / "test_max_integration.py").read_text() + (REPO / "tests" / "engine_venv.py").read_text(), a
        else:
            assert a in ("-e", ".", "--upgrade", "pip", "setuptools"), a


def _pytest(args: list[str]) -> None:
    markers = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    it = iter(args[3:])
    for a in it:
        if a == "-m":
            used = set(re.findall(r"\w+", next(it))) - {"not", "and", "or"}
            assert used <= markers, used
        elif not a.startswith("-"):
            assert (REPO / a).exists(), a


def _max_launch(argv: list[str]) -> None:
    """Without MAX (as here), the documented launch lines answer one line, exit 2."""
    import importlib.util

    if importlib.util.find_spec("max") is not None:
        pytest.skip("MAX is installed here: tests/test_max_integration.py runs the launcher")
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1 and "MAX is not installed" in res.stderr, res.stderr


def _trtllm_serve(args: list[str]) -> None:
    yaml = REPO / args[args.index("--extra_llm_api_options") + 1]
    text = yaml.read_text()
    module = re.search(r"connector_module:\s*(\S+)", text).group(1)
    import importlib

    mod = importlib.import_module(module)
    for cls in re.findall(r"connector_(?:scheduler|worker)_class:\s*(\S+)", text):
        assert hasattr(mod, cls), cls


def _vllm_server(args: list[str]) -> None:
    conf = json.loads(args[args.index("--kv-transfer-config") + 1])
    path = REPO / (conf["kv_connector_module_path"].replace("gdskv.", "gdskv/", 1).replace(".", "/"))
    source = "".join(p.read_text() for p in path.glob("*.py"))
    assert f"class {conf['kv_connector']}" in source
    assert conf["kv_load_failure_policy"] in ("recompute", "fail")


AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION")
"""The standard credential variables docs/remote.md tells users to set (gdskv reads them through obstore)."""
S3_SETUP = {"minio": ("server",), "mc": ("alias", "mb"), "aws": ("s3",)}
"""The object-store tools docs/remote.md uses to make a bucket, and their subcommands."""


def _export(args: list[str]) -> None:
    for assignment in args[1:]:
        name, _, value = assignment.partition("=")
        assert name in ("GDSKV_STORE", "GDSKV_CONFIG", *AWS_VARIABLES), name
        assert value


def _heredoc_config(line: str, workspace: Path) -> None:
    """``cat > FILE <<'EOF'`` (or ``>>``) with a gdskv TOML body: the body must load as a config."""
    first, *body, _end = line.splitlines()
    args = shlex.split(first.split("<<")[0])
    assert args[0] == "cat" and args[1] in (">", ">>") and args[2].endswith(".toml"), first
    path = workspace / "heredoc.toml"
    path.write_text("\n".join(body) + "\n")
    load_config(str(path))


def check_line(line: str, workspace: Path) -> str:
    """Run or check one documented line; what was done (``ran`` / ``parsed``)."""
    done = "parsed"
    if "\n" in line and "<<" in line.splitlines()[0]:
        _heredoc_config(line, workspace)
        return done
    for part in (p.strip() for p in line.split("&&")):
        args = shlex.split(part, comments=True)
        if args[0] == "gdskv":
            _gdskv(workspace, args[1:])
            done = "ran"
        elif args[:2] in (["python", "-m"], ["python3", "-m"]) and args[2] == "gdskv.connectors.max_launch" \
                or args[0].endswith("/gdskv-max"):
            _max_launch([sys.executable, "-m", "gdskv.connectors.max_launch", *args[3:]] if args[0].startswith("python")
                        else [str(Path(sys.executable).parent / "gdskv-max"), *args[1:]])
            done = "ran"
        elif (args[0] == "pip" or args[0].endswith("/pip")) and args[1] == "install":
            _pip_install(args)
        elif args[:3] == ["python", "-m", "pytest"]:
            _pytest(args)
        elif args[:3] == ["python3", "-m", "venv"]:
            assert len(args) == 4
        elif args[0] == "trtllm-serve":
            _trtllm_serve(args)
        elif args[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]:
            _vllm_server(args)
        elif args[0] == "mv":  # the rename after a redirected gdskv line
            assert len(args) == 3 and ">" in line and args[1] in line.split("&&")[0], line
        elif args[0] == "export":
            _export(args)
        elif args[0] in S3_SETUP:
            assert args[1] in S3_SETUP[args[0]], part
        else:
            raise AssertionError(f"no rule checks this documented line; add one to tests/test_docs.py: {part}")
    return done


def test_docs_have_command_lines_to_check() -> None:
    assert len(ALL_FENCED) >= 10 and len(ALL_INLINE) >= 9


@pytest.mark.parametrize("where,line", ALL_FENCED, ids=[w for w, _ in ALL_FENCED])
def test_documented_command_line(where: str, line: str, workspace: Path) -> None:
    check_line(line, workspace)


def _options_of(command: str) -> set[str]:
    res = CliRunner().invoke(main, [*command.split(), "--help"])
    assert res.exit_code == 0, res.output
    return set(re.findall(r"(--[a-z][a-z-]*)", res.output))


@pytest.mark.parametrize("where,span", ALL_INLINE, ids=[f"{w}:{s[:40]}" for w, s in ALL_INLINE])
def test_documented_command_and_options_exist(where: str, span: str) -> None:
    words = span.split()
    if words[1:3] == ["bench", "--"]:  # `gdskv bench -- --help`: the benchmark's own options
        res = CliRunner().invoke(main, ["bench", "--", "--help"])
        assert res.exit_code == 0 and "--page-size" in res.output, res.output
        return
    command = words[1]
    if "|" in command or command.startswith("["):  # `gdskv info | ls | ...`: each is a command
        for name in re.findall(r"\b[a-z]+\b", " ".join(words[1:])):
            _options_of(name)
        return
    offered = _options_of(command) | {"--help"}
    named = set(re.findall(r"(--[a-z][a-z-]*)", span))
    assert named <= offered, (span, named - offered)


def test_example_config_named_in_the_docs_loads() -> None:
    assert load_config(str(REPO / "config" / "gdskv.toml")).store_path


def test_bench_store_script_takes_the_flags_the_readme_names() -> None:
    readme = (REPO / "README.md").read_text()
    m = re.search(r"`python (scripts/bench_store\.py[^`]*)`", readme)
    assert m
    flags = set(re.findall(r"--[a-z-]+", m.group(1)))
    from gdskv import bench

    for flag in flags:
        options, _ = bench.parse_args([flag, "1M"] if flag == "--page-size" else [flag, "/tmp"])
        assert options is not None
