"""The reference engine's scheduler loop, and how it drives a TensorRT-LLM-style KV cache connector.

``ReferenceEngine.generate`` runs steps until every prompt has its tokens and every page is back.
One step, in order (the spec's call sequence):

1. reclaim the pages sliding windows have passed (reported ``-1`` in place from then on);
2. admit waiting requests while capacity lasts: per KV allocation, exactly one
   ``get_num_new_matched_tokens(request, 0)``; the engine honours full blocks only and at most
   ``prompt_len - 1`` tokens; then the pages for the loaded prefix plus the first chunk, and
   ``update_state_after_alloc[_by_layer_group]`` with those blocks only;
3. allocate the pages this step's chunks need and build a ``SchedulerOutput`` of deltas;
4. ``meta = scheduler.build_connector_meta(output)``; per worker (a pickle round trip of ``meta``
   stands in for the broadcast) ``bind_connector_meta(meta)``, ``start_load_kv(None)``;
5. per layer: every worker's ``wait_for_layer_load(layer, None)``, the layer, every worker's
   ``save_kv_layer(layer, None)``; then every worker's ``wait_for_save(None)``;
6. sample; a request that completes gets ``request_finished[_by_layer_group]`` and, if that says a
   save is under way, keeps its pages;
7. every worker's ``get_finished(finished_gen_req_ids, started_loading_req_ids)``; a request id
   counts once every rank has reported it. Saved requests give their pages back; loaded requests
   join the forward pass from the next step.

A step with nothing to compute (every admitted request loading or saving) still makes every call
above, the per-layer ones included, so workers are polled until their transfers finish.

An asynchronously loading request sits outside the forward pass: the other requests keep
stepping (decoding, prefilling) while its pages fill, and it joins the batch in the step after
every rank's ``get_finished`` reported it loaded. ``generate(arrival_steps=...)`` lets a request
arrive while others run, and ``step_log`` records every step's duration and batch (what
``scripts/bench_decode_under_load.py`` measures).

Extension (not in TensorRT-LLM): if a worker has ``get_load_failures() -> list[int]``, the engine
calls it once per step after ``wait_for_save`` and again after ``get_finished``. A listed request
whose loaded prefix has not yet been through a complete step has that prefix discarded: the
step's result for it is dropped (or, loading asynchronously, it joins the batch with nothing
loaded) and it recomputes from token 0 on the same pages (its next report has
``computed_position`` 0 and no new blocks). This is how the store's promise "a corrupt chunk is
a miss, never wrong KV" is checked end to end; a worker using it must not save KV computed on top
of a failed load.
"""
from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from gdskv.engine.config import EngineConfig, ModelConfig
from gdskv.engine.driver import ConnectorDriver, ConnectorError
from gdskv.engine.heap import keep_freed_memory
from gdskv.engine.model import ReferenceModel
from gdskv.engine.pool import PagedKvCache
from gdskv.engine.requests import EngineRequest, GenerationResult, RequestState, SchedulerOutput
from gdskv.layout import BAD_PAGE_INDEX, KvCacheLayout, valid_page_slots

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One step of ``ReferenceEngine``: its wall time (admission through ``get_finished``) and
    the requests it computed (``decoding``: past their prompt; ``prefilling``) or held out of the
    forward pass while they loaded (``loading``)."""

    seconds: float
    decoding: tuple[int, ...]
    prefilling: tuple[int, ...]
    loading: tuple[int, ...]


class ReferenceEngine:
    """A paged-attention decoder on CPU that drives a KV cache connector exactly as the spec says.

    ``scheduler`` and ``workers`` (one per TP rank) are the connector's two halves, duck-typed on
    the spec's ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker`` methods; both ``None``
    runs without a connector. Bring-up checks (callback sets, layout registration) run here.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig = EngineConfig(),
        scheduler: Any = None,
        workers: Optional[Sequence[Any]] = None,
    ) -> None:
        if (scheduler is None) != (workers is None):
            raise ConnectorError("a connector needs both its scheduler and its workers")
        self.model_cfg, self.engine_cfg = model_cfg, engine_cfg
        self.model = ReferenceModel(model_cfg)
        self.kv = PagedKvCache(model_cfg, engine_cfg)
        self.connector = ConnectorDriver(scheduler, workers, self.kv.layouts) if scheduler is not None else None
        self._next_request_id = 0
        self._waiting: deque[EngineRequest] = deque()
        self._active: list[EngineRequest] = []
        # Ids every rank has reported saved, kept until the request is complete: a worker may
        # report a save done before it is told the request finished.
        self._saved_ready: set[int] = set()
        self._failed_loads: set[int] = set()
        """Ids some rank reported a failed load for, kept until the request uses or drops it."""
        self._arrivals: list[tuple[int, EngineRequest]] = []
        """(step, request) not yet arrived (``generate(arrival_steps=...)``)."""
        self._steps = 0
        self.step_log: list[StepRecord] = []
        """Every step ``generate`` ran (``StepRecord``), appended as they complete."""

    @property
    def layouts(self) -> list[KvCacheLayout]:
        """Each TP rank's ``KvCacheLayout`` (what its worker was registered with)."""
        return self.kv.layouts

    def poison_intact(self) -> bool:
        """True when no pool's poisoned last slot was written (needs ``poison_last_slot``).

        The slot reads as NaN, so a read of it (by the engine, or by a connector that saves it and
        loads it back) shows up as NaN logits instead.
        """
        return self.kv.poison_intact()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Union[int, Sequence[int]],
        cache_salts: Optional[Sequence[Optional[str]]] = None,
        split_prefill_at: Union[None, int, Sequence[Optional[int]]] = None,
        arrival_steps: Optional[Sequence[int]] = None,
    ) -> list[GenerationResult]:
        """Greedy-decode ``max_new_tokens`` tokens for every prompt (or that many per prompt), all
        in one batch.

        ``split_prefill_at`` forces a prefill chunk boundary at that token (per prompt, or one for
        all): chunks run up to it, then restart from it. A run that loaded N tokens from the
        connector is bit-identical to a from-scratch run split at N. ``arrival_steps`` (one per
        prompt) holds a prompt back until that many steps of this call have run; its
        ``ttft_s`` counts from its arrival.
        """
        news = [int(n) for n in max_new_tokens] if isinstance(max_new_tokens, Sequence) else [int(max_new_tokens)] * len(prompts)
        if len(news) != len(prompts) or any(n < 1 for n in news):
            raise ValueError("max_new_tokens must be >= 1 (one for all prompts, or one per prompt)")
        salts = list(cache_salts) if cache_salts is not None else [None] * len(prompts)
        splits = list(split_prefill_at) if isinstance(split_prefill_at, Sequence) else [split_prefill_at] * len(prompts)
        arrivals = [int(a) for a in arrival_steps] if arrival_steps is not None else [0] * len(prompts)
        if len(salts) != len(prompts) or len(splits) != len(prompts) or len(arrivals) != len(prompts):
            raise ValueError("cache_salts, split_prefill_at and arrival_steps need one entry per prompt")
        now = time.perf_counter()
        requests = []
        for prompt, salt, split, max_new in zip(prompts, salts, splits, news):
            tokens = [int(t) for t in prompt]
            if not tokens or not all(0 <= t < self.model_cfg.vocab_size for t in tokens):
                raise ValueError(f"a prompt must be non-empty with token ids in [0, {self.model_cfg.vocab_size})")
            request = EngineRequest(self._next_request_id, tokens, max_new, salt, split, now, len(self.kv.groups))
            need = self._blocks_needed(request)
            for gid, capacity in enumerate(self.kv.allocator.capacity):
                if need > capacity:
                    raise ValueError(
                        f"a request of {len(tokens)} + {max_new} tokens needs {need} pages in layer group {gid}, "
                        f"more than num_slots allows ({capacity})"
                    )
            self._next_request_id += 1
            requests.append(request)
        self._steps = 0
        self._arrivals = sorted(((a, r) for a, r in zip(arrivals, requests) if a > 0), key=lambda ar: ar[0])
        self._waiting.extend(r for a, r in zip(arrivals, requests) if a <= 0)
        threads = torch.get_num_threads()
        if self.engine_cfg.intra_op_threads is not None:
            torch.set_num_threads(self.engine_cfg.intra_op_threads)
        if self.engine_cfg.steady_heap:
            keep_freed_memory()
        if self.engine_cfg.freeze_heap:
            gc.collect()
            gc.freeze()
        try:
            self._run_until_drained()
        finally:
            torch.set_num_threads(threads)
            if self.engine_cfg.freeze_heap:
                gc.unfreeze()
        return [
            GenerationResult(r.request_id, r.prompt, r.generated, r.logits, r.num_loaded, r.ttft_s, r.kv_pages)
            for r in requests
        ]

    # -- the step loop ------------------------------------------------------------------------

    def _run_until_drained(self) -> None:
        """Step until no request waits, runs, loads or saves; raise if the connector stalls."""
        last_progress = time.monotonic()
        while self._waiting or self._active or self._arrivals:
            while self._arrivals and self._arrivals[0][0] <= self._steps:
                _, request = self._arrivals.pop(0)
                request.arrival_s = time.perf_counter()
                self._waiting.append(request)
            if self._step():
                last_progress = time.monotonic()
                continue
            if time.monotonic() - last_progress > self.engine_cfg.async_timeout_s:
                stuck = {r.request_id: r.state.value for r in self._active}
                raise ConnectorError(f"no progress for {self.engine_cfg.async_timeout_s}s waiting on the connector: {stuck}")
            time.sleep(0.001)

    def _blocks_needed(self, request: EngineRequest) -> int:
        """Worst-case pages in each layer group over the request's life (every token but the last
        is fed); the same in every group, since a reclaimed page still takes an ordinal."""
        return -(-(request.prompt_len + request.max_new_tokens - 1) // self.kv.tokens_per_block)

    def _can_admit(self, request: EngineRequest) -> bool:
        """Room in the batch, and in every group's pool for this request's worst case on top of
        what the admitted requests may still allocate."""
        admitted = [r for r in self._active if r.state in (RequestState.RUNNING, RequestState.LOADING)]
        if len(admitted) >= self.engine_cfg.max_batch:
            return False
        need = self._blocks_needed(request)
        for gid in range(len(self.kv.groups)):
            promised = sum(max(0, self._blocks_needed(r) - len(r.block_ids[gid])) for r in admitted)
            if self.kv.allocator.num_free(gid) - promised < need:
                return False
        return True

    def _allocate_through(self, request: EngineRequest, end: int) -> None:
        """Give ``request`` a page in every group for each block ordinal up to token ``end``."""
        blocks = -(-end // self.kv.tokens_per_block)
        for gid, ids in enumerate(request.block_ids):
            while len(ids) < blocks:
                ids.append(self.kv.allocator.allocate(gid))

    def _release(self, request: EngineRequest) -> None:
        for gid, ids in enumerate(request.block_ids):
            for _, slot in valid_page_slots(ids):
                self.kv.allocator.free(gid, slot)
        request.state = RequestState.DONE
        self._active.remove(request)

    def _admit(self, request: EngineRequest) -> bool:
        """Ask the connector, allocate the first chunk, tell the connector. True if it loads async.

        An asynchronous offer the engine honours for 0 tokens (less than a block) is not waited
        for: the request runs at once, and its first report's ``computed_position`` 0 says so.
        """
        tpb = self.kv.tokens_per_block
        offered, is_async = self.connector.matched_tokens(request) if self.connector else (0, False)
        honoured = min(offered, request.prompt_len - 1) // tpb * tpb
        request.num_loaded = request.num_computed = honoured
        request.offered_sync = 0 if is_async else offered
        request.prefix_verified = honoured == 0
        self._allocate_through(request, request.next_chunk(self.engine_cfg.chunk_size)[1])
        if self.connector:
            self.connector.after_alloc(request)
        loading = is_async and honoured > 0
        request.state = RequestState.LOADING if loading else RequestState.RUNNING
        self._active.append(request)
        return loading

    def _step(self) -> bool:
        """One scheduler iteration (see the module docstring); True if any request made progress."""
        began = time.perf_counter()
        self._steps += 1
        self._reclaim_passed_pages()
        admitted, started_loading = self._admit_waiting()
        scheduled = [r for r in self._active if r.state is RequestState.RUNNING]
        chunks = {r.request_id: r.next_chunk(self.engine_cfg.chunk_size) for r in scheduled}
        output = SchedulerOutput()
        for r in [r for r in admitted if r.state is RequestState.LOADING] + scheduled:
            start, end = chunks.get(r.request_id, (r.num_computed, r.num_computed))
            self._allocate_through(r, end)
            is_new, data = r.report(end - start)
            (output.new_requests if is_new else output.cached_requests).append(data)

        if self.connector:
            self.connector.begin_step(output)
        last_rows = self._forward(scheduled, chunks)
        if self.connector:
            self._failed_loads |= self.connector.end_forward()
        discarded = self._discard_failed_loads()

        finished_gen: list[int] = []
        for r in scheduled:
            if r.request_id in discarded:
                continue
            r.num_computed, r.prefix_verified = chunks[r.request_id][1], True
            if r.num_computed >= r.prompt_len:
                logits = self.model.logits(last_rows[r.request_id])
                if not r.logits:
                    r.ttft_s = time.perf_counter() - r.arrival_s
                r.logits.append(logits)
                r.generated.append(int(torch.argmax(logits)))
            if r.is_complete:
                self._complete(r, finished_gen)
        loading = tuple(r.request_id for r in self._active if r.state is RequestState.LOADING)
        moved = self._poll_finished(finished_gen, started_loading)
        decoding = tuple(r.request_id for r in scheduled if chunks[r.request_id][0] >= r.prompt_len)
        prefilling = tuple(r.request_id for r in scheduled if chunks[r.request_id][0] < r.prompt_len)
        self.step_log.append(StepRecord(time.perf_counter() - began, decoding, prefilling, loading))
        return moved or bool(scheduled or admitted)

    def _reclaim_passed_pages(self) -> None:
        """Free the pages sliding windows have passed; their entries become ``-1`` in place.

        A request whose loaded prefix is not verified yet keeps every page, so a reported load
        failure can still be recomputed on them.
        """
        tpb = self.kv.tokens_per_block
        for r in self._active:
            if r.state is not RequestState.RUNNING or not r.prefix_verified:
                continue
            for group in self.kv.groups:
                ids = r.block_ids[group.layer_group_id]
                for ordinal in group.passed_blocks(ids, r.num_computed, tpb):
                    self.kv.allocator.free(group.layer_group_id, ids[ordinal])
                    ids[ordinal] = BAD_PAGE_INDEX

    def _admit_waiting(self) -> tuple[list[EngineRequest], list[int]]:
        """Admit waiting requests in arrival order while they fit; also the ids that load async."""
        admitted: list[EngineRequest] = []
        started_loading: list[int] = []
        while self._waiting and self._can_admit(self._waiting[0]):
            request = self._waiting.popleft()
            admitted.append(request)
            if self._admit(request):
                started_loading.append(request.request_id)
        return admitted, started_loading

    def _forward(self, scheduled: list[EngineRequest], chunks: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
        """Run every layer over every scheduled chunk, between the workers' per-layer hooks.

        Returns each request's last output row (the one logits are taken from).
        """
        rows = {r.request_id: self.model.embed(r.get_tokens(0)[slice(*chunks[r.request_id])]) for r in scheduled}
        kvs = {r.request_id: self.kv.request_kv(r.block_ids) for r in scheduled}
        for layer in range(self.model_cfg.num_layers):
            if self.connector:
                self.connector.before_layer(layer)
            for r in scheduled:
                positions = list(range(*chunks[r.request_id]))
                rows[r.request_id] = self.model.layer_forward(layer, rows[r.request_id], positions, kvs[r.request_id])
            if self.connector:
                self.connector.after_layer(layer)
        return {rid: out[-1] for rid, out in rows.items()}

    def _discard_failed_loads(self) -> set[int]:
        """Apply the ``get_load_failures`` extension to running requests; return the ids whose
        loaded prefix was dropped (a loading request's failure waits for ``_poll_finished``)."""
        discarded = set()
        for r in self._active:
            if r.request_id not in self._failed_loads or r.state is RequestState.LOADING:
                continue
            self._failed_loads.discard(r.request_id)
            if r.state is not RequestState.RUNNING:
                continue
            if r.prefix_verified:
                log.warning("connector reported a load failure for request %d after its loaded KV was used; ignored", r.request_id)
                continue
            self._drop_loaded_prefix(r)
            discarded.add(r.request_id)
        return discarded

    def _drop_loaded_prefix(self, r: EngineRequest) -> None:
        log.warning("connector reported a load failure for request %d: recomputing its %d loaded tokens", r.request_id, r.num_loaded)
        r.num_loaded = r.num_computed = 0
        r.prefix_verified = True

    def _poll_finished(self, finished_gen: list[int], started_loading: list[int]) -> bool:
        """``get_finished`` on every worker: release saved requests, start loaded ones. True if any."""
        if not self.connector:
            return False
        saved, loaded = self.connector.poll_finished(finished_gen, started_loading)
        self._failed_loads |= self.connector.load_failures()
        self._saved_ready |= saved
        moved = False
        for r in list(self._active):
            if r.state is RequestState.SAVING and r.request_id in self._saved_ready:
                self._saved_ready.discard(r.request_id)
                self.connector.forget(r.request_id)
                self._release(r)
                moved = True
            elif r.state is RequestState.LOADING and r.request_id in loaded:
                r.state = RequestState.RUNNING
                if r.request_id in self._failed_loads:
                    self._failed_loads.discard(r.request_id)
                    self._drop_loaded_prefix(r)
                moved = True
        self._failed_loads &= {r.request_id for r in self._active}  # reports about requests gone
        return moved

    def _complete(self, request: EngineRequest, finished_gen: list[int]) -> None:
        """Hand a complete request's pages to the connector (or back to the allocator)."""
        if self.engine_cfg.capture_pages:
            request.kv_pages = {
                (rank, gid, ordinal): self.kv.page_bytes(rank, gid, slot)
                for rank in range(self.engine_cfg.tp_size)
                for gid, ids in enumerate(request.block_ids)
                for ordinal, slot in valid_page_slots(ids)
            }
        if self.connector and self.connector.request_finished(request):
            request.state = RequestState.SAVING
            finished_gen.append(request.request_id)
        else:
            self._release(request)
