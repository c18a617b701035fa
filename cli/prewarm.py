"""``gdskv prewarm PROMPTS...``: compute the KV of known prompts once, so servers start warm.

Prompt sources: ``.txt`` (one prompt per blank-line-separated paragraph), ``.jsonl`` (one object
per line with ``prompt``, or ``messages`` rendered with the tokenizer's chat template), or a
directory (every ``.txt`` / ``.jsonl`` directly in it, in name order). Each prompt is tokenized and
prefilled (one output token) through an engine with gdskv's connector attached, so its full blocks
land in the store:

- ``reference`` (default, runs anywhere): the CPU reference engine (``gdskv.engine``) driving the
  TensorRT-LLM connector (``gdskv.connectors.trtllm``). Its model is
  ``reference_model_config(vocab)``: deterministic weights, so every process that builds it shares
  the namespace. Without ``--tokenizer`` the text is tokenized by ``ByteTokenizer`` (UTF-8 bytes).
- ``trtllm``: TensorRT-LLM's ``LLM`` with the connector config, ``generate(..., max_tokens=1)``.
- ``vllm``: vLLM's offline ``LLM`` with gdskv's KV connector (``gdskv.connectors.vllm``,
  ``kv_load_failure_policy="recompute"``), ``generate(..., max_tokens=1)``.
- ``max``: Modular MAX's offline ``LLM`` with gdskv's KVConnector installed.

Prompts that cannot run (empty, an empty file, longer than ``--max-prompt-tokens``, unreadable
lines, an engine error) are reported and skipped; the others go on. Exit 1 when any prompt failed.
Progress: a bar on a terminal, else a status line every ``gdskv --status-every`` seconds that
names the blocks the current prompt has written so far (a long prompt shows progress within
seconds).
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import click
from rich.table import Table

from gdskv.cli._common import UsageProblem, capacity_limits, config_of, human_bytes, print_json
from gdskv.cli._remote import remote_client
from gdskv.cli.push import push_namespaces_of
from gdskv.cli.output import console
from gdskv.cli.progress import Work, status_every
from gdskv.config import GdsKvConfig

REFERENCE_TOKENS_PER_BLOCK = 16


# --- prompts -------------------------------------------------------------------------------------
@dataclass
class Prompt:
    """One prompt as read from a file: text or chat messages, or why it could not be read."""

    source: str  # "file.txt#3" (paragraph) or "file.jsonl:7" (line)
    text: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    error: Optional[str] = None


def _not_utf8(e: UnicodeDecodeError, base: int = 0) -> str:
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {base + e.start})"


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a plain file"


def _read_bytes(path: Path) -> bytes:
    """The file's bytes; ValueError (the reason, for a failed prompt) when it cannot be read. Only a
    regular file is opened, and without blocking: a FIFO named ``x.txt`` is refused, not waited on."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file ({_file_kind(st.st_mode)})")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)  # what was opened: the path may have changed since the stat
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"not a regular file ({_file_kind(st.st_mode)})")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"cannot read: {e.strerror or e}") from None


def _read_txt(path: Path) -> list[Prompt]:
    try:
        data = _read_bytes(path)
        text = data.decode("utf-8").removeprefix("\ufeff")  # a byte order mark is not prompt text
    except ValueError as e:  # UnicodeDecodeError included: a .txt that is not text is one failure
        return [Prompt(str(path), error=_not_utf8(e) if isinstance(e, UnicodeDecodeError) else str(e))]
    paragraphs = re.split(r"\n[ \t]*\n", text)
    return [Prompt(f"{path}#{i + 1}", text=p.strip()) for i, p in enumerate(p for p in paragraphs if p.strip())] or _empty(path)


def _empty(path: Path) -> list[Prompt]:
    return [Prompt(str(path), error="empty file: no prompt in it")]


def _read_jsonl(path: Path) -> list[Prompt]:
    """One prompt per non-blank line (split on ``\\n`` only). A line that is not UTF-8 fails alone;
    a file that is not UTF-8 and holds NUL bytes (binary, UTF-16) is one failure."""
    try:
        data = _read_bytes(path)
    except ValueError as e:
        return [Prompt(str(path), error=str(e))]
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        if b"\0" in data:
            return [Prompt(str(path), error=_not_utf8(e))]
    if data.startswith(b"\xef\xbb\xbf"):
        data = b"   " + data[3:]  # a UTF-8 byte order mark: blanked, offsets unchanged
    out, offset = [], 0
    for n, raw in enumerate(data.split(b"\n"), 1):
        start, offset = offset, offset + len(raw) + 1
        src = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            out.append(Prompt(src, error=_not_utf8(e, start)))
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            out.append(Prompt(src, error=f"not JSON: {e}"))
            continue
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            out.append(Prompt(src, text=obj["prompt"]))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"] and all(isinstance(m, dict) and "content" in m for m in obj["messages"]):
            out.append(Prompt(src, messages=obj["messages"]))
        else:
            out.append(Prompt(src, error="needs a string 'prompt' or a non-empty list of 'messages' with 'role' and 'content'"))
    return out or _empty(path)


def read_prompts(paths: Sequence[str]) -> list[Prompt]:
    """Every prompt of the given files and directories, in order; a usage error for a path that does
    not exist, a file that is not ``.txt`` / ``.jsonl`` or a directory without any. A file that
    cannot be read (not a regular file, permission denied, not UTF-8) is a failed prompt."""
    out: list[Prompt] = []
    for raw in paths:
        p = Path(raw)
        try:
            is_dir = stat.S_ISDIR(os.stat(p).st_mode)
        except FileNotFoundError:
            raise UsageProblem(f"{p} does not exist") from None
        except OSError as e:
            out.append(Prompt(str(p), error=f"cannot read: {e.strerror or e}"))
            continue
        if is_dir:
            try:
                files = sorted(f for f in p.iterdir() if f.suffix in (".txt", ".jsonl"))
            except OSError as e:
                out.append(Prompt(str(p), error=f"cannot list the directory: {e.strerror or e}"))
                continue
            if not files:
                raise UsageProblem(f"{p} has no .txt or .jsonl files")
        else:
            files = [p]
        for f in files:
            if f.suffix == ".txt":
                out += _read_txt(f)
            elif f.suffix == ".jsonl":
                out += _read_jsonl(f)
            else:
                raise UsageProblem(f"{f}: prompt files are .txt (paragraphs) or .jsonl (prompt / messages per line)")
    return out


# --- tokenizers ----------------------------------------------------------------------------------
class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


class ByteTokenizer:
    """Deterministic tokenizer for the reference engine without a Hugging Face tokenizer: one
    token per UTF-8 byte (ids 0..255). Chat messages are rendered as ``<|role|>\\ncontent\\n`` for
    each message, then ``<|assistant|>\\n``, and encoded the same way."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(f"<|{m.get('role', 'user')}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)


class HfTokenizer:
    """A Hugging Face tokenizer with its chat template: one ``load``ed by name (``--tokenizer`` for
    the reference engine, chat prompts for MAX), or TensorRT-LLM's ``LLM.tokenizer`` wrapped."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    @classmethod
    def load(cls, name: str) -> "HfTokenizer":
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UsageProblem("--tokenizer needs the transformers package (pip install transformers)") from None
        try:
            return cls(AutoTokenizer.from_pretrained(name))
        except (OSError, ValueError) as e:  # not found, no network, not a tokenizer
            raise UsageProblem(f"--tokenizer {name}: {' '.join(str(e).split())}") from None

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))

    def render_chat_text(self, messages: list[dict[str, Any]]) -> str:
        return str(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


# --- the reference engine ------------------------------------------------------------------------
def reference_model_config(vocab_size: int = ByteTokenizer.vocab_size) -> Any:
    """The reference model prewarm runs (and any process that wants its KV back must run)."""
    from gdskv.engine.config import ModelConfig

    return ModelConfig(vocab_size=vocab_size)


@dataclass
class ReferenceStack:
    """The reference engine with the TensorRT-LLM connector's two halves attached."""

    engine: Any
    scheduler: Any
    worker: Any
    tokens_per_block: int

    def close(self) -> None:
        self.worker.close()


def reference_stack(cfg: GdsKvConfig, vocab_size: int, max_prompt_tokens: int, max_new_tokens: int = 1) -> ReferenceStack:
    """Build the reference engine + connector on ``cfg`` (passed to the connector as an object;
    its worker installs the config's budget when the engine registers the layout). Called by ``prewarm``;
    also by tests to generate from prewarmed prompts in a fresh process."""
    from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
    from gdskv.engine import EngineConfig, ReferenceEngine

    tpb = REFERENCE_TOKENS_PER_BLOCK
    model = reference_model_config(vocab_size)
    engine_cfg = EngineConfig(tokens_per_block=tpb, num_slots=-(-(max_prompt_tokens + max_new_tokens) // tpb) + 1, chunk_size=256, max_batch=1)
    args = StandaloneLlmArgs.build(model.fingerprint(), tpb)
    scheduler, worker = GdsKvScheduler(args, config=cfg), GdsKvWorker(args, config=cfg)
    engine = ReferenceEngine(model, engine_cfg, scheduler, [worker])
    return ReferenceStack(engine, scheduler, worker, tpb)


# --- the run -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one prompt added to the store (``blocks_present``: reference engine only)."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_present: Optional[int] = None


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


def _tokenize(tok: Tokenizer, p: Prompt, max_tokens: int) -> list[int]:
    """The prompt's token ids; ValueError (the prompt is skipped) when it is unreadable, empty or
    longer than ``max_tokens``. Called by the reference, TensorRT-LLM and vLLM runners."""
    if p.error:
        raise ValueError(p.error)
    ids = tok.render_chat(p.messages) if p.messages is not None else tok.encode(p.text or "")
    if not ids or (p.messages is None and not (p.text or "").strip()):
        raise ValueError("empty prompt")
    if len(ids) > max_tokens:
        raise ValueError(f"too long: {len(ids)} tokens > --max-prompt-tokens {max_tokens}")
    return ids


class _Runner(Protocol):
    def run(self, prompt: Prompt) -> Outcome: ...

    def progress(self) -> str:
        """What the prompt running now has done so far (called from the progress thread)."""
        ...

    def close(self) -> Optional[Outcome]:
        """Stop the engine. An engine in other processes answers with what the whole run added
        to the store, measured once they ended (their last writes land as they stop): it
        replaces the sum over prompts. None: the per-prompt outcomes stand."""
        ...


class _ReferenceRunner:
    def __init__(self, cfg: GdsKvConfig, tok: Tokenizer, max_tokens: int, salt: Optional[str]) -> None:
        self.tok, self.max_tokens, self.salt = tok, max_tokens, salt
        self._current: Optional[tuple[str, int, int]] = None
        self.stack = reference_stack(cfg, tok.vocab_size, max_tokens)
        if self.stack.worker.namespace is None:  # the worker logged why (an OSError on the store)
            self.stack.close()
            raise UsageProblem(f"the connector could not use the store {cfg.store_path} (see the error above); refusing to "
                               f"run prompts that would write nothing. {_STORE_HINT}")

    def run(self, prompt: Prompt) -> Outcome:
        ids = _tokenize(self.tok, prompt, self.max_tokens)
        w = self.stack.worker
        ns = w.namespace
        published, existing = w.counters.saves_published, w.counters.saves_existing
        self._current = (prompt.source, len(ids), published + existing)
        nbytes = ns.counters["bytes_written"] if ns is not None else 0
        [res] = self.stack.engine.generate([ids], max_new_tokens=1, cache_salts=[self.salt])
        return Outcome(
            blocks_written=w.counters.saves_published - published,
            bytes_written=(ns.counters["bytes_written"] if ns is not None else 0) - nbytes,
            blocks_present=res.prefill_tokens_loaded // self.stack.tokens_per_block + w.counters.saves_existing - existing,
        )

    def progress(self) -> str:
        if self._current is None:
            return ""
        source, tokens, start = self._current
        c = self.stack.worker.counters
        return (f"{source} ({tokens} tokens): {c.saves_published + c.saves_existing - start} of "
                f"{tokens // self.stack.tokens_per_block} blocks stored so far")

    def close(self) -> None:
        self.stack.close()


class _StoreDelta:
    """Blocks and bytes an external engine added over the whole run, measured on the store (its
    counters live in the engine's processes): one scan when the runner is made, before any
    prompt, and one by ``written`` once the engine stopped (its processes write as they stop), so
    two scans whatever the number of prompts. Made by the TensorRT-LLM, vLLM and MAX runners."""

    def __init__(self, cfg: GdsKvConfig) -> None:
        from gdskv.store import PageStore

        self.store = PageStore.open(cfg.store_path)
        self._start = self._measure()

    def _measure(self) -> tuple[int, int]:
        from gdskv.eviction import scan_store

        t = scan_store(self.store, with_parents=False)
        return len(t), t.total_bytes

    def written(self) -> Outcome:
        """What the store gained since the runner was made, scanned now."""
        now = self._measure()
        return Outcome(blocks_written=now[0] - self._start[0], bytes_written=now[1] - self._start[1])


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


class _ExternalRunner:
    """An engine that runs in its own processes (TensorRT-LLM, MAX, vLLM): its counters live
    there, so neither progress inside a prompt nor what one prompt wrote is known here (``run``
    answers an empty ``Outcome``); what the run wrote is measured on the store (``delta``)
    after its processes ended."""

    delta: _StoreDelta

    def progress(self) -> str:
        return ""

    def close(self) -> Optional[Outcome]:
        self.stop()
        return self.delta.written()

    def stop(self) -> None:
        raise NotImplementedError


class _TrtllmRunner(_ExternalRunner):
    """TensorRT-LLM's LLM API with gdskv's connector (needs ``tensorrt_llm``)."""

    def __init__(self, cfg: GdsKvConfig, model: str, tokenizer: Optional[str], max_tokens: int,
                 engine_args: dict[str, Any]) -> None:
        try:
            from tensorrt_llm import LLM, SamplingParams
            from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig
        except ImportError:
            raise UsageProblem("--engine trtllm needs TensorRT-LLM (tensorrt_llm does not import in this Python)") from None
        os.environ["GDSKV_STORE"] = cfg.store_path
        self.params = SamplingParams(max_tokens=1)
        self.llm = LLM(model=model, tokenizer=tokenizer, kv_cache_config=KvCacheConfig(enable_block_reuse=True),
                       kv_connector_config=KvCacheConnectorConfig(connector_module="gdskv.connectors.trtllm",
                                                                  connector_scheduler_class="GdsKvScheduler",
                                                                  connector_worker_class="GdsKvWorker"),
                       **engine_args)
        self.tok = HfTokenizer(self.llm.tokenizer)
        self.max_tokens = max_tokens
        self.delta = _StoreDelta(cfg)

    def run(self, prompt: Prompt) -> Outcome:
        ids = _tokenize(self.tok, prompt, self.max_tokens)
        self.llm.generate([ids], self.params)
        return Outcome()

    def stop(self) -> None:
        self.llm.shutdown()


class _MaxRunner(_ExternalRunner):
    """Modular MAX's offline ``LLM`` with gdskv's KVConnector installed (needs ``max``), watched
    so that an engine that stops fails the run instead of hanging it (``OfflineLlm``)."""

    def __init__(self, cfg: GdsKvConfig, model: str, max_tokens: int, engine_args: dict[str, Any]) -> None:
        try:
            from max.pipelines.lib import PipelineArgs
        except ImportError:
            raise UsageProblem("--engine max needs Modular MAX (max does not import in this Python)") from None
        from gdskv.connectors.max import ENV_HOOK, ENV_MODEL, install
        from gdskv.connectors.max.offline import OfflineLlm

        os.environ["GDSKV_STORE"] = cfg.store_path
        os.environ.setdefault(ENV_MODEL, os.path.abspath(model) if os.path.isdir(model) else model)
        os.environ[ENV_HOOK] = "1"  # MAX's spawned model worker installs the hook too (gdskv.cli.main)
        install()
        self.llm = OfflineLlm(PipelineArgs.from_flat_kwargs(model_path=model, kv_connector_config={"type": "rust_tiered"},
                                                            **engine_args))
        self.hf: Optional[HfTokenizer] = None
        self.model, self.max_tokens = model, max_tokens
        self.delta = _StoreDelta(cfg)

    def run(self, prompt: Prompt) -> Outcome:
        if prompt.error:
            raise ValueError(prompt.error)
        if prompt.messages is not None:
            self.hf = self.hf or HfTokenizer.load(self.model)
            text = self.hf.render_chat_text(prompt.messages)
        else:
            text = prompt.text or ""
        if not text.strip():
            raise ValueError("empty prompt")
        # MAX offloads the blocks a step committed at its next step: one token would end the
        # request before its prompt's blocks are written.
        self.llm.generate([text], max_new_tokens=2)
        return Outcome()

    def stop(self) -> None:
        self.llm.close()


class _VllmRunner(_ExternalRunner):
    """vLLM's offline ``LLM`` with gdskv's KV connector (needs ``vllm``): the kv-transfer-config
    of docs/vllm.md, ``kv_load_failure_policy="recompute"`` included. vLLM's own prefix cache stays
    on (a prompt repeated within the run is served from the device); the connector saves every
    full block it computes."""

    def __init__(self, cfg: GdsKvConfig, model: str, tokenizer: Optional[str], max_tokens: int,
                 engine_args: dict[str, Any]) -> None:
        try:
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
        except ImportError:
            raise UsageProblem("--engine vllm needs vLLM (vllm does not import in this Python)") from None
        os.environ["GDSKV_STORE"] = cfg.store_path
        self.params = SamplingParams(max_tokens=1)
        self.llm = LLM(model=model, tokenizer=tokenizer, kv_transfer_config=KVTransferConfig(
            kv_connector="GdsKvConnector", kv_connector_module_path="gdskv.connectors.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config={"store_path": cfg.store_path}),
            **engine_args)
        self.tok = HfTokenizer(self.llm.get_tokenizer())
        self.max_tokens = max_tokens
        self.delta = _StoreDelta(cfg)

    def run(self, prompt: Prompt) -> Outcome:
        ids = _tokenize(self.tok, prompt, self.max_tokens)
        self.llm.generate([{"prompt_token_ids": ids}], self.params, use_tqdm=False)
        return Outcome()

    def stop(self) -> None:
        del self.llm


_STORE_HINT = "Pass --store PATH or set GDSKV_STORE."

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
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = _PYTHON_WORDS.get(raw, raw)
    return out


def check_store(cfg: GdsKvConfig) -> None:
    """Open (creating it where missing) the store prewarm writes to, before any engine is built: a
    path that is not a gdskv store and cannot become one is a usage problem, reported in one line."""
    from gdskv.store import PageStore, StoreError

    root = Path(cfg.store_path)
    try:
        if root.exists() and not root.is_dir():
            raise UsageProblem(f"{root} is not a gdskv store (it is a file, not a directory); refusing to use it. {_STORE_HINT}")
        PageStore.open(root, create=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except StoreError as e:
        raise UsageProblem(f"{e}. {_STORE_HINT}") from None
    except (OSError, ValueError) as e:  # ValueError: an unreadable zarr.json
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageProblem(f"{root} is not a gdskv store and cannot be one here ({why}); refusing to use it. {_STORE_HINT}") from None


def _runner(engine: str, cfg: GdsKvConfig, model: Optional[str], tokenizer: Optional[str], max_tokens: int,
            salt: Optional[str], engine_arg_items: Sequence[str] = ()) -> _Runner:
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
    check_store(cfg)
    from gdskv.connectors.max.offline import EngineStopped
    from gdskv.connectors.trtllm import ConnectorSetupError
    from gdskv.store import StoreError

    try:
        if engine == "reference":
            assert tok is not None
            runner: _Runner = _ReferenceRunner(cfg, tok, max_tokens, salt)
        elif engine == "trtllm":
            runner = _TrtllmRunner(cfg, model or "", tokenizer, max_tokens, engine_args)
        elif engine == "vllm":
            runner = _VllmRunner(cfg, model or "", tokenizer, max_tokens, engine_args)
        else:
            runner = _MaxRunner(cfg, model or "", max_tokens, engine_args)
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
@click.argument("prompts", nargs=-1, required=True, type=click.Path())
@click.option("--engine", type=click.Choice(["reference", "trtllm", "vllm", "max"]), default="reference", show_default=True)
@click.option("--model", default=None, help="Model for trtllm / vllm / max (a Hugging Face id or a local path).")
@click.option("--tokenizer", default=None, help="Tokenizer (Hugging Face id or path); default: the model's, or bytes for the reference engine.")
@click.option("--cache-salt", "cache_salt", default=None, help="Cache salt mixed into every block key (reference engine).")
@click.option("--max-prompt-tokens", "max_tokens", type=click.IntRange(1), default=4096, show_default=True, help="Longer prompts are skipped.")
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
