"""The worker role of the vLLM connector (each TP rank's worker process): executes each step's
``StepMeta`` against this rank's KV pool through ``gdskv.service.KvService``. No vLLM import.

- loads (``start_load_kv``) are posted at once and never awaited in the step: the request waits
  in vLLM's WAITING_FOR_REMOTE_KVS until ``finished`` reports it in ``finished_recving``; a block
  that did not load (missing, corrupt, I/O error) is reported by ``load_errors`` in that same
  step or before, so vLLM recomputes from it;
- saves (``wait_for_save``, once the step's forward pass has written every layer) are posted
  and never awaited in the step; a request the scheduler holds is reported in
  ``finished_sending`` once the saves of the step that holds it are posted and all of its saves
  are done (with speculative decoding vLLM calls ``get_finished`` before ``wait_for_save``, so
  the id vLLM reports finished may come before those saves are posted);
- a preempted request's saves are awaited (``preempted``) before vLLM reuses its blocks.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import torch

from gdskv import streams
from gdskv.service import KvService
from gdskv.transfer import LoadStatus
from gdskv.connectors.vllm.translate import PagePool, StepMeta

log = logging.getLogger(__name__)


class WorkerSide:
    """State of one worker; ``service`` is this rank's (its ``spec.tp_rank``)."""

    def __init__(self, service: KvService, layer_names: list[str], num_blocks: int, layer_page_bytes: int):
        self.service = service
        self._layer_names = layer_names
        self._num_blocks = num_blocks
        self._layer_page_bytes = layer_page_bytes
        self.pool: Optional[PagePool] = None
        self._loads: dict[str, list[tuple[int, Optional[Future]]]] = {}
        self._saves: dict[str, list[Future]] = {}
        self._held: dict[str, int] = {}
        """Requests the scheduler holds -> the step whose metadata holds them (its saves are the
        request's last)."""
        self._posted = 0
        """The last step whose saves are posted."""
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self._last_step = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pool = PagePool(kv_caches, self._layer_names, self._num_blocks, self._layer_page_bytes)
        self.service.register_memory([t for t, _ in self.pool.layers])

    def _fresh(self, meta: Any) -> Optional[StepMeta]:
        return meta if isinstance(meta, StepMeta) and self.pool is not None else None

    # -- handle_preemptions / start_load_kv / wait_for_save --------------------------------------
    def preempted(self, meta: Any) -> None:
        meta = self._fresh(meta)
        if meta is None:
            return
        pending = [f for rid in meta.preempted for f in self._saves.pop(rid, ())]
        if pending:
            for f in pending:  # each wait hurries the transfer's reaper (gdskv.futures.PageFuture)
                f.exception()

    def _hold(self, meta: StepMeta) -> None:
        for rid in meta.held:
            self._held.setdefault(rid, meta.step)

    def start_loads(self, meta: Any) -> None:
        meta = self._fresh(meta)
        if meta is None:
            return
        self._hold(meta)
        if meta.step <= self._last_step:
            return
        self._last_step = meta.step
        ready = streams.record_ready(devices=[self.pool.device]) if meta.loads else None
        for rid, ops in meta.loads:
            posted = self._loads.setdefault(rid, [])
            for gid, mine in _by_group(ops):
                futures = self.service.load_many(gid, [(op.key, self.pool.segments(op.page_slot)) for op in mine], ready=ready,
                                                 background=True)
                posted.extend((op.page_slot, fut) for op, fut in zip(mine, futures))

    def post_saves(self, meta: Any) -> None:
        meta = self._fresh(meta)
        if meta is None:
            return
        self._hold(meta)
        ready = streams.record_ready(devices=[self.pool.device]) if meta.saves else None
        for rid, ops in meta.saves:
            for gid, mine in _by_group(ops):
                futures = self.service.save_many(gid, [(op.key, op.parent_key, self.pool.segments(op.page_slot))
                                                       for op in mine], ready=ready)
                posted = [f for f in futures if f is not None]
                if posted:
                    self._saves.setdefault(rid, []).extend(posted)
        self._posted = max(self._posted, meta.step)

    # -- get_finished / get_block_ids_with_load_errors ---------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)``: held requests (among ids vLLM reported
        finished) whose saves are all done, and requests whose loads are all done (their failed
        blocks are in ``load_errors`` by then)."""
        self.service.reap()
        for rid in finished_req_ids:
            rid = str(rid)
            if rid in self._held:
                self._finished.add(rid)
            elif rid in self._saves and all(f.done() for f in self._saves[rid]):
                del self._saves[rid]
        recving = set()
        for rid, posted in list(self._loads.items()):
            if all(f is None or f.done() for _, f in posted):
                for block_id, f in posted:
                    if f is None or f.exception() is not None or f.result() is not LoadStatus.LOADED:
                        self._errors.add(block_id)
                del self._loads[rid]
                recving.add(rid)
        sending = set()
        for rid in list(self._finished):
            if self._held[rid] <= self._posted and all(f.done() for f in self._saves.get(rid, ())):
                self._saves.pop(rid, None)
                self._finished.discard(rid)
                del self._held[rid]
                sending.add(rid)
        self.service.flush_stats()
        return sending, recving

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        if errors:
            log.warning("gdskv: %d block(s) did not load from the store; vLLM recomputes them", len(errors))
        return errors

    def close(self) -> None:
        self.service.close()


def _by_group(ops: Sequence[Any]) -> list[tuple[int, list[Any]]]:
    """A request's ops split by layer group, in first-seen order: one service batch each."""
    groups: dict[int, list[Any]] = {}
    for op in ops:
        groups.setdefault(op.layer_group_id, []).append(op)
    return list(groups.items())
