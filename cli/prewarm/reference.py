"""The reference engine prewarm runs by default: the CPU reference engine (``gdskv.engine``)
with the TensorRT-LLM connector's two halves, on a model every process can rebuild."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from gdskv.cli._common import STORE_HINT, UsageProblem
from gdskv.cli.prewarm.prompts import Prompt
from gdskv.cli.prewarm.runners import Outcome
from gdskv.cli.prewarm.tokenizers import ByteTokenizer, Tokenizer, tokenize
from gdskv.config import GdsKvConfig

REFERENCE_TOKENS_PER_BLOCK = 16


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


class ReferenceRunner:
    """``prewarm --engine reference``: the reference engine with the connector, in this process."""

    def __init__(self, cfg: GdsKvConfig, tok: Tokenizer, max_tokens: int, salt: Optional[str]) -> None:
        self.tok, self.max_tokens, self.salt = tok, max_tokens, salt
        self._current: Optional[tuple[str, int, int]] = None
        self.stack = reference_stack(cfg, tok.vocab_size, max_tokens)
        if self.stack.worker.namespace is None:  # the worker logged why (an OSError on the store)
            self.stack.close()
            raise UsageProblem(f"the connector could not use the store {cfg.store_path} (see the error above); refusing to "
                               f"run prompts that would write nothing. {STORE_HINT}")

    def run(self, prompt: Prompt) -> Outcome:
        """Prefill one prompt; a ``RuntimeError`` when any of its saves failed (not a budget's
        refusal: a read-only or broken store), so the prompt is listed as failed."""
        ids = tokenize(self.tok, prompt, self.max_tokens)
        w = self.stack.worker
        ns = w.namespace
        published, existing = w.counters.saves_published, w.counters.saves_existing
        self._current = (prompt.source, len(ids), published + existing)
        nbytes = ns.counters["bytes_written"] if ns is not None else 0
        failed_before = _failed_saves(ns)
        [res] = self.stack.engine.generate([ids], max_new_tokens=1, cache_salts=[self.salt])
        failed = _failed_saves(ns) - failed_before
        if failed:
            raise RuntimeError(f"{failed} of its blocks could not be saved (see the warning above)")
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


def _failed_saves(ns: Any) -> int:
    """The saves ``ns`` dropped for a reason other than the byte budget (its counters)."""
    return ns.counters["saves_dropped"] - ns.counters["saves_dropped_budget"] if ns is not None else 0
