"""What every prewarm runner is and answers: ``Runner`` (one per run, a prompt at a time),
``Outcome`` (what a prompt or a run added to the store), ``StoreDelta`` and ``ExternalRunner``
for engines whose counters live in processes of their own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from gdskv.cli.prewarm.prompts import Prompt
from gdskv.config import GdsKvConfig


@dataclass
class Outcome:
    """What one prompt added to the store (``blocks_present``: reference engine only)."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_present: Optional[int] = None


@dataclass


class Runner(Protocol):
    """An engine prewarm drives, one prompt at a time."""

    def run(self, prompt: Prompt) -> Outcome:
        """Prefill ``prompt``; what it added to the store. Raises to fail the prompt alone."""
        ...

    def progress(self) -> str:
        """What the prompt running now has done so far (called from the progress thread)."""
        ...

    def close(self) -> Optional[Outcome]:
        """Stop the engine. An engine in other processes answers with what the whole run added
        to the store, measured once they ended (their last writes land as they stop): it
        replaces the sum over prompts. None: the per-prompt outcomes stand."""
        ...


class StoreDelta:
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


class ExternalRunner:
    """An engine that runs in its own processes (TensorRT-LLM, MAX, vLLM): its counters live
    there, so neither progress inside a prompt nor what one prompt wrote is known here (``run``
    answers an empty ``Outcome``); what the run wrote is measured on the store (``delta``)
    after its processes ended."""

    delta: StoreDelta

    def progress(self) -> str:
        return ""

    def close(self) -> Optional[Outcome]:
        self.stop()
        return self.delta.written()

    def stop(self) -> None:
        raise NotImplementedError
