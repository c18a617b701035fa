"""The ``gdskv prewarm`` command: its options checked, the store opened, the engine's runner
built, every prompt run, the summary printed (and pushed with ``--remote``)."""
from __future__ import annotations

import errno
import importlib.util
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import click
from rich.table import Table

from gdskv import jsondoc
from gdskv.cli._common import STORE_HINT, UsageProblem, capacity_limits, config_of, human_bytes, print_json
from gdskv.cli._remote import remote_client
from gdskv.cli.output import console
from gdskv.cli.prewarm.engines import ENGINE_MODULES, MaxRunner, TrtllmRunner, VllmRunner, missing_engine
from gdskv.cli.prewarm.prompts import read_prompts
from gdskv.cli.prewarm.reference import ReferenceRunner
from gdskv.cli.prewarm.runners import Runner
from gdskv.cli.prewarm.tokenizers import ByteTokenizer, HfTokenizer
from gdskv.cli.progress import Work, status_every
from gdskv.cli.push import push_namespaces_of
from gdskv.config import GdsKvConfig


@dataclass
class Summary:
    engine: str
    prompts: int = 0
    done: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)
    blocks_written: int = 0
    blocks_present: Optional[int] = 0
    bytes_written: int = 0
    seconds: float = 0.0
    evicted: Optional[int] = None  # chunks the capacity limits evicted meanwhile; None: no limit set


def _limited(cfg: GdsKvConfig) -> bool:
    """Whether the config sets a capacity limit (a byte budget or a free-space floor)."""
    from gdskv.eviction import Limits

    return Limits.of(cfg).active


class _Evictions:
    """Chunks the store's capacity limits evicted while prewarm ran, by any process: the REMOVE
    records its eviction journals gained. Made before the runner, counted after it stopped; not
    made where the config sets no limit (nothing is evicted then)."""

    def __init__(self, cfg: GdsKvConfig) -> None:
        from gdskv.eviction.journal import journal_ends
        from gdskv.store import PageStore

        self.store = PageStore.open(cfg.store_path)
        self._ends: Optional[dict[str, int]]
        try:
            self._ends = journal_ends(self.store)
        except FileNotFoundError:  # a store no process has journaled in yet
            self._ends = {}
        except OSError:
            self._ends = None

    def count(self) -> Optional[int]:
        """The REMOVE records since ``__init__``; None where the journals cannot be read."""
        from gdskv.eviction.journal import REMOVE, read_journals

        if self._ends is None:
            return None
        try:
            recs, _ = read_journals(self.store, self._ends)
        except FileNotFoundError:
            return 0
        except OSError:
            return None
        return int((recs["kind"] == REMOVE).sum())


_SET_BY_PREWARM = {
    "trtllm": ("model", "tokenizer", "kv_cache_config", "kv_connector_config"),
    "vllm": ("model", "tokenizer", "kv_transfer_config"),
    "max": ("model_path", "kv_connector_config"),
}
_PYTHON_WORDS = {"True": True, "False": False, "None": None}


def parse_engine_args(engine: str, items: Sequence[str]) -> dict[str, Any]:
    """``--engine-arg KEY=VALUE`` items as the keyword arguments of the engine's constructor:
    ``-`` in a key becomes ``_`` (``block-size=32`` as on the engine's own command line), a value
    is JSON where it parses (``32``, ``false``, ``{"a": 1}``) or True/False/None, else the string.
    A usage problem for the reference engine, a malformed item, or a key prewarm sets itself."""
    if items and engine == "reference":
        raise UsageProblem("--engine-arg is for --engine trtllm, vllm and max (the reference engine takes none)")
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise UsageProblem(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. block_size=32")
        if key in _SET_BY_PREWARM[engine]:
            raise UsageProblem(f"--engine-arg {key}: prewarm sets it itself (use --model / --tokenizer, or the gdskv config)")
        try:
            out[key] = jsondoc.loads(raw)
        except ValueError:
            out[key] = _PYTHON_WORDS.get(raw, raw)
    return out


MAX_PROMPT_TOKENS = 1 << 20
"""The longest ``--max-prompt-tokens``: the reference engine sizes its KV pool for it (256 MiB)."""


def check_store(cfg: GdsKvConfig) -> None:
    """Open (creating it where missing) the store prewarm writes to, before any engine is built: a
    path that is not a gdskv store and cannot become one is a usage problem, reported in one line."""
    from gdskv.store import PageStore, StoreError

    root = Path(cfg.store_path)
    try:
        if root.exists() and not root.is_dir():
            raise UsageProblem(f"{root} is not a gdskv store (it is a file, not a directory); refusing to use it. {STORE_HINT}")
        PageStore.open(root, create=True)
        if not os.access(root, os.W_OK | os.X_OK):  # a store already, on a read-only mount or not ours to write
            why = os.strerror(errno.EROFS if os.statvfs(root).f_flag & os.ST_RDONLY else errno.EACCES)
            raise UsageProblem(f"{root} is a gdskv store this process cannot write ({why}); refusing to use it. {STORE_HINT}")
    except StoreError as e:
        raise UsageProblem(f"{e}. {STORE_HINT}") from None
    except (OSError, ValueError) as e:  # ValueError: an unreadable zarr.json
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageProblem(f"{root} is not a gdskv store and cannot be one here ({why}); refusing to use it. {STORE_HINT}") from None


def _runner(engine: str, cfg: GdsKvConfig, model: Optional[str], tokenizer: Optional[str], max_tokens: int,
            salt: Optional[str], engine_arg_items: Sequence[str] = ()) -> Runner:
    """The engine's runner, its options checked first, then the store (``check_store``), then the
    engine built; an error of the store or the connector at bring-up, or an engine argument the
    engine refuses, is a one-line usage problem."""
    engine_args = parse_engine_args(engine, engine_arg_items)
    if engine == "reference":
        if model not in (None, "reference"):
            raise UsageProblem("--engine reference runs its own model: leave --model out (or pass 'reference')")
    elif salt is not None:
        raise UsageProblem(f"--cache-salt is only supported with --engine reference (pass the salt through {engine}'s own request API)")
    elif not model:
        raise UsageProblem(f"--engine {engine} needs --model")
    tok = (HfTokenizer.load(tokenizer) if tokenizer else ByteTokenizer()) if engine == "reference" else None
    if engine != "reference" and importlib.util.find_spec(ENGINE_MODULES[engine]) is None:  # before the store is made
        raise missing_engine(engine)
    check_store(cfg)
    from gdskv.connectors.max.offline import EngineStopped
    from gdskv.connectors.trtllm import ConnectorSetupError
    from gdskv.store import StoreError

    try:
        if engine == "reference":
            assert tok is not None
            runner: Runner = ReferenceRunner(cfg, tok, max_tokens, salt)
        elif engine == "trtllm":
            runner = TrtllmRunner(cfg, model or "", tokenizer, max_tokens, engine_args)
        elif engine == "vllm":
            runner = VllmRunner(cfg, model or "", tokenizer, max_tokens, engine_args)
        else:
            runner = MaxRunner(cfg, model or "", max_tokens, engine_args)
    except (ConnectorSetupError, StoreError, OSError, EngineStopped) as e:
        raise UsageProblem(f"cannot start the {engine} engine on the store {cfg.store_path}: {' '.join(str(e).split())}") from None
    except (TypeError, ValueError) as e:  # an engine argument the engine refuses (or a value of the wrong kind)
        if not engine_args:
            raise
        raise UsageProblem(f"cannot start the {engine} engine with --engine-arg {', '.join(engine_args)}: "
                           f"{' '.join(str(e).split())}") from None
    return runner


@contextmanager
def _engine_output_to_stderr() -> Iterator[None]:
    """While an engine in other processes runs, point file descriptor 1 at stderr: vLLM logs to
    stdout, in this process and in the processes it starts (they inherit the descriptor), and
    stdout carries prewarm's summary only (``--json`` is read by programs)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@click.command()
@click.argument("prompts", nargs=-1, required=True, type=click.Path(readable=False))
@click.option("--engine", type=click.Choice(["reference", "trtllm", "vllm", "max"]), default="reference", show_default=True)
@click.option("--model", default=None, help="Model for trtllm / vllm / max (a Hugging Face id or a local path).")
@click.option("--tokenizer", default=None, help="Tokenizer (Hugging Face id or path); default: the model's, or bytes for the reference engine.")
@click.option("--cache-salt", "cache_salt", default=None, help="Cache salt mixed into every block key (reference engine).")
@click.option("--max-prompt-tokens", "max_tokens", type=click.IntRange(1, MAX_PROMPT_TOKENS), default=4096, show_default=True,
              help="Longer prompts are skipped (the reference engine's KV pool holds this many tokens).")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="Passed to the engine's constructor (vLLM's / TensorRT-LLM's LLM, MAX's PipelineArgs); give it the "
                   "servers' settings (block_size=32, dtype=bfloat16, ...) so its KV pages are the ones they look up. "
                   "VALUE is JSON where it parses, else a string. Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--remote", is_flag=True, help="Then push the store's namespaces to [gdskv.remote], so a fleet is warmed once.")
@click.pass_context
def prewarm(ctx: click.Context, prompts: tuple[str, ...], engine: str, model: Optional[str], tokenizer: Optional[str],
            cache_salt: Optional[str], max_tokens: int, engine_args: tuple[str, ...], as_json: bool, remote: bool) -> None:
    """Prefill prompts from files through an engine with the connector, so their KV is stored."""
    cfg = config_of(ctx)
    if remote:
        remote_client(ctx)[1].close()  # no [gdskv.remote]: a usage error before any prompt runs
    items = read_prompts(prompts)  # before the store: a usage error here creates no store
    summary = Summary(engine, prompts=len(items), blocks_present=0 if engine == "reference" else None)
    with nullcontext() if engine == "reference" else _engine_output_to_stderr():
        runner = _runner(engine, cfg, model, tokenizer, max_tokens, cache_salt, engine_args)
        evictions = _Evictions(cfg) if _limited(cfg) else None
        t_all = time.perf_counter()
        try:
            with Work("prewarm", len(items), "prompts", status_every(ctx), bar=not as_json, detail=runner.progress) as work:
                for p in items:
                    try:
                        out = runner.run(p)
                    except Exception as e:  # one prompt's failure (empty, too long, engine error) skips it
                        summary.failed.append({"source": p.source, "error": str(e) or type(e).__name__})
                    else:
                        summary.done += 1
                        summary.blocks_written += out.blocks_written
                        summary.bytes_written += out.bytes_written
                        if summary.blocks_present is not None and out.blocks_present is not None:
                            summary.blocks_present += out.blocks_present
                    work.advance()
        finally:
            settled = runner.close()
    if settled is not None:
        summary.blocks_written, summary.bytes_written = settled.blocks_written, settled.bytes_written
    if evictions is not None:
        summary.evicted = evictions.count()
    summary.seconds = time.perf_counter() - t_all
    pushed = None
    if remote:
        from gdskv.store import PageStore

        store = PageStore.from_config(cfg, create=False)
        pushed = push_namespaces_of(ctx, [store.namespace(ns.spec) for ns in store.namespaces()])
    if as_json:
        print_json(asdict(summary) | ({"remote": pushed[0]} if pushed else {}))
    else:
        out_console = console()
        if summary.failed:
            t = Table(title="skipped prompts")
            t.add_column("prompt")
            t.add_column("why")
            for f in summary.failed:
                t.add_row(f["source"], f["error"])
            out_console.print(t)
        present = "" if summary.blocks_present is None else f", {summary.blocks_present} blocks already present"
        out_console.print(f"{summary.done} of {summary.prompts} prompts done: {summary.blocks_written} blocks written{present}, "
                          f"{human_bytes(summary.bytes_written)} in {summary.seconds:.1f} s ({engine} engine)")
        if summary.evicted:
            out_console.print(f"the store's capacity limits ({capacity_limits(cfg)}) evicted {summary.evicted} chunks "
                              "meanwhile, least recent first: the prompts warmed first may not all be held", highlight=False)
        if pushed:
            out_console.print(pushed[2], highlight=False)
    if summary.failed or (pushed and not pushed[1]):
        ctx.exit(1)
