"""``GdsKvWorker``: the rank-local half of the TensorRT-LLM connector, on ``gdskv.service.KvService``.

It translates TensorRT-LLM's worker calls (registration, the per-step and per-layer hooks,
``get_finished``) into the service's page loads and saves of this rank's shard, addressed through
the registered ``KvCacheLayout`` (``page_segments``), ordered against the engine's stream
(``gdskv.streams``), counted by the service.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import Future
from functools import partial
from typing import Any, Optional

from gdskv import streams
from gdskv.config import GdsKvConfig, load_config
from gdskv.connectors.trtllm.base import KvCacheConnectorWorker
from gdskv.connectors.trtllm.deployment import ConnectorSetupError, Deployment, peers
from gdskv.connectors.trtllm.inflight import WorkerCounters, settle, settle_loads
from gdskv.connectors.trtllm.layout_check import check_layout, region_tensors
from gdskv.layout import single_pool_layout
from gdskv.planner import ConnectorMetadata
from gdskv.service import KvService, ServiceSetupError
from gdskv.service.paced import PacedLoad, post_pages
from gdskv.store import Namespace, NamespaceSpec
from gdskv.transfer import LoadStatus, PageTransfer, page_segments

log = logging.getLogger(__name__)


class GdsKvWorker(KvCacheConnectorWorker):
    """The rank-local half: executes the step's metadata against this rank's KV pool.

    Constructed on every rank as ``GdsKvWorker(llm_args)``; registered once with the pool; then,
    per step, ``start_load_kv`` posts the loads, ``wait_for_layer_load(i)`` waits for the loads of
    layer ``i``'s group, ``save_kv_layer(i)`` posts a group's saves once its last layer has been
    computed (a page holds every layer of its group), ``wait_for_save`` makes sure every save is
    posted. No save blocks the step: saves finish in the background and are reported by
    ``get_finished``. Loads the scheduler made asynchronous (``StepMetadata.async_loads``) are
    posted a slice per step (``gdskv.service.paced``) from the step after the one that admitted the
    request (which carries its lookup) and finished by ``service.reap`` at each step's start and
    end, never awaited: ``get_finished`` reports the request loaded once every page landed, and
    ``get_load_failures`` lists it if one did not.

    Device ordering (``gdskv.streams``): a readiness recorded on the engine's stream when the slots
    are handed over (``start_load_kv`` for loads, the group's last ``save_kv_layer`` for saves) is
    what the transfer thread waits on before it writes (loads) or reads (saves) a page, so kernels
    queued before still see the slot as they left it. The engine's later kernels read a loaded page
    only after ``wait_for_layer_load`` saw its load complete (host order). A sliding-window page is
    saved from a snapshot taken in stream order, since the cache may reclaim and reuse the page
    once the window moves, before the save has read it.
    """

    def __init__(self, llm_args: Any, config: Optional[GdsKvConfig] = None):
        """TensorRT-LLM constructs it with ``llm_args`` alone (gdskv's settings then come from
        ``load_config()``); in-process callers (the reference engine's stacks) pass ``config``."""
        super().__init__(llm_args)
        self._cfg = config if config is not None else load_config()
        self._deployment = Deployment.from_llm_args(llm_args, self._cfg)
        self._peers = peers(self._cfg.store_path, self._deployment.model, self._deployment.tp_size)
        self.service: Optional[KvService] = None  # this rank's, built at registration
        self._layout: Any = None
        self._group_layers: dict[int, frozenset[int]] = {}
        self._group_of_layer: dict[int, int] = {}
        """Model layer -> its layer group id (resolved once at registration, not per layer hook)."""
        self._windows: dict[int, Optional[int]] = {}
        self._device: Any = None
        """Where the pool lives (ordering on its current stream when the engine passes none)."""
        # this step
        self._step_meta: Optional[ConnectorMetadata] = None
        self._last_step = 0
        self._step_loads: dict[int, list[tuple[int, Future]]] = defaultdict(list)
        self._layers_done: set[int] = set()
        self._groups_posted: set[int] = set()
        # across steps
        self._loads: dict[int, list[Future]] = {}
        """Loads inside the forward pass (awaited per layer), per request, until settled."""
        self._async_loads: dict[int, PacedLoad] = {}
        """Asynchronous loads (the request is outside the batch), per request, until all landed."""
        self._saves: dict[int, list[Future]] = {}
        self._awaiting_save: dict[int, None] = {}
        self._awaiting_load: dict[int, None] = {}
        self._load_failures: dict[int, None] = {}
        self._suppressed = 0

    @property
    def counters(self) -> WorkerCounters:
        """A snapshot of this rank's transfer outcomes (the service counts them)."""
        return WorkerCounters.of(self.service, self._suppressed)

    @property
    def _transfer(self) -> Optional[PageTransfer]:
        """The service's page transfer of this rank; None when inactive or closed."""
        return self.service.transfer if self.service is not None else None

    @property
    def namespace(self) -> Optional[Namespace]:
        """The store namespace this rank saves to and loads from (None when inactive)."""
        return self._transfer.ns if self._transfer is not None else None

    # -- registration -------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """Called once at bring-up with the single pool ``[num_blocks, num_layers, kv_factor,
        block_size]`` (one layer group, full attention)."""
        self._register(single_pool_layout(kv_cache_tensor, self._deployment.tokens_per_block))

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Called once at bring-up with the pool described per layer group and region (TensorRT-LLM's
        ``KvCacheLayout`` or gdskv's, duck-typed). Refuses a layout it cannot describe."""
        self._register(layout)

    def _register(self, layout: Any) -> None:
        d = self._deployment
        check_layout(layout, d.tokens_per_block if d.tokens_per_block_given else None)
        spec = NamespaceSpec.from_layout(layout, model=d.model, tp_rank=d.tp_rank, tp_size=d.tp_size)
        self._layout = layout
        self._group_layers = {g.layer_group_id: frozenset(int(i) for i in g.layer_ids) for g in layout.groups}
        self._group_of_layer = {layer: gid for gid, layers in self._group_layers.items() for layer in layers}
        self._windows = {g.layer_group_id: g.window_size for g in layout.groups}
        self._device = layout.groups[0].regions[0].slot_tensor(0).device
        try:
            self.service = service = KvService(self._cfg, spec, served_by="trtllm")
        except ServiceSetupError as e:
            raise ConnectorSetupError(str(e)) from None
        if service.transfer is None:  # the service logged why; this rank loads and saves nothing
            return
        ns = service.namespace
        others = service.other_geometries()
        if others:
            log.info("gdskv: rank %d uses namespace %s; the store's other namespace(s) %s for model %r have another "
                     "geometry and are not served from", d.tp_rank, ns.id, ", ".join(others), spec.model)
        service.register_memory(region_tensors(layout))
        self._peers.publish(d.tp_rank, spec)
        log.info("gdskv: rank %d/%d registered %d layer group(s) as namespace %s", d.tp_rank, d.tp_size,
                 len(layout.groups), ns.id)

    # -- one step -----------------------------------------------------------------------------
    def start_load_kv(self, stream: Any) -> None:
        """Start of the forward pass: post this step's loads (all groups) and reset step state
        (load failures not collected by the previous step's end are forgotten)."""
        meta = self._metadata if isinstance(self._metadata, ConnectorMetadata) else None
        if meta is not None and meta.step <= self._last_step:
            meta = None  # already executed: the runtime bound no new metadata this step
        self._step_meta = meta
        self._step_loads.clear()
        self._layers_done.clear()
        self._groups_posted.clear()
        if self._transfer is None or meta is None:
            return
        self._load_failures.clear()
        self._last_step = meta.step
        self._peers.bind(getattr(meta, "deployment", ""), self.service.namespace.store)
        background = getattr(meta, "async_loads", frozenset())
        ready = None
        paced: dict[int, list[tuple[int, Any]]] = {}
        for gid in self._group_layers:
            group = self._layout.group(gid)
            ops = list(meta.loads_of_group(gid))
            if ops and ready is None:  # kernels queued so far may still use the slots: loads wait for them
                ready = streams.record_ready(stream, [self._device])
            now = []
            for rid, op in ops:
                if rid in background:
                    paced.setdefault(rid, []).append((gid, op))
                else:
                    now.append((rid, op))
            futures = self.service.load_many(gid, [(op.key, page_segments(group, op.page_slot)) for _, op in now],
                                             ready=ready)
            for (rid, op), fut in zip(now, futures):
                self._step_loads[gid].append((rid, fut))
                self._loads.setdefault(rid, []).append(fut)
        self._pump()
        for rid, rid_ops in paced.items():  # a slice per step from the next (this one did the lookup)
            self._async_loads[rid] = PacedLoad(rid_ops, partial(post_pages, self.service, self._layout, ready=ready),
                                               start_at=2)

    def _pump(self) -> None:
        """Finish the saves and loads that landed (``KvService.reap``), then post the loads' next slices."""
        self.service.reap()
        for load in self._async_loads.values():
            load.pump()

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Before layer ``layer_idx`` computes: wait for the loads into its group's pages."""
        if self._layout is not None:
            self._finish_loads(self._group_of_layer[int(layer_idx)])

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """After layer ``layer_idx``'s compute is enqueued: once every layer of its group has been,
        post that group's saves."""
        if self._layout is None:
            return
        self._layers_done.add(int(layer_idx))
        gid = self._group_of_layer[int(layer_idx)]
        if self._group_layers[gid] <= self._layers_done:
            self._post_saves(gid, stream)

    def wait_for_save(self, stream: Any) -> None:
        """End of the forward pass: settle every load and post (enqueue) any save not yet posted,
        which is what the spec asks of it. Never waits for a save: those finish in the background
        and are reaped by ``get_finished``."""
        for gid in self._group_layers:
            self._finish_loads(gid)
            self._post_saves(gid, stream)

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """Ids whose saves (resp. loads) are complete, only among ids ever passed in here; the rest
        stay pending and are reported by a later call. A save is complete once its chunk is
        published (or found existing, or dropped); a finished request is reported saved only once
        no load into its pages is in flight either (one aborted while loading). A request whose
        asynchronous load did not land whole is reported loaded and listed by
        ``get_load_failures``."""
        for rid in finished_gen_req_ids:
            self._awaiting_save[int(rid)] = None
            if int(rid) in self._async_loads:  # aborted while loading: post no more of it
                self._async_loads[int(rid)].cancel()
        for rid in started_loading_req_ids:
            self._awaiting_load[int(rid)] = None
        self._pump()
        settle(self._saves, "save")
        settle(self._loads, None)  # logged when awaited, in _finish_loads
        for rid, bad, total in settle_loads(self._async_loads):
            log.warning("gdskv: %d of %d asynchronous page loads of request %d failed; its KV is recomputed where the "
                        "engine can", bad, total, rid)
            self._load_failures[rid] = None
            self._peers.load_failed(rid)
        busy = self._saves.keys() | self._loads.keys() | self._async_loads.keys()
        saved = [rid for rid in self._awaiting_save if rid not in busy]
        loaded = [rid for rid in self._awaiting_load if rid not in self._loads and rid not in self._async_loads]
        for rid in saved:
            del self._awaiting_save[rid]
            self._peers.finished(rid)
        for rid in loaded:
            del self._awaiting_load[rid]
        return saved, loaded

    def get_load_failures(self) -> list[int]:
        """Reference-engine extension (TensorRT-LLM has no such hook): request ids whose loaded KV failed
        verification (missing or corrupt chunk) since the last call (at most since this step's
        ``start_load_kv``), for the engine to recompute; called after ``wait_for_save`` (loads in the
        forward pass) and after ``get_finished`` (asynchronous loads)."""
        failed = list(self._load_failures)
        self._load_failures.clear()
        for rid in failed:
            self._peers.finished(rid)  # recomputed from scratch: what it computes from now on is its own
        return failed

    def close(self) -> None:
        """Wait for in-flight transfers and write the counters (tests, the demo, shutdown)."""
        if self.service is not None:
            self.service.close()

    # -- internals ----------------------------------------------------------------------------
    def _finish_loads(self, gid: int) -> None:
        """Wait for this step's loads into group ``gid``; a load that is not LOADED fails its request."""
        for rid, fut in self._step_loads.pop(gid, []):
            exc = fut.exception()
            status = fut.result() if exc is None else None
            if status is LoadStatus.LOADED:
                continue
            log.warning("gdskv: a load %s; the request's KV is recomputed where the engine can",
                        f"failed: {exc}" if exc is not None else f"came back {status.value}")
            self._load_failures[rid] = None
            self._peers.load_failed(rid)

    @property
    def tracked(self) -> int:
        """Entries in this worker's per-request maps (the leak checks read it)."""
        return sum(map(len, (self._loads, self._async_loads, self._saves, self._awaiting_save, self._awaiting_load,
                             self._load_failures)))

    def _post_saves(self, gid: int, stream: Any) -> None:
        """Post group ``gid``'s saves of this step (once), skipping requests whose load failed on
        any rank, in this step or an earlier one: their KV was computed on top of bytes that are
        not theirs (``Peers.tainted_now``: this process's ranks, and others' through the store)."""
        meta = self._step_meta
        if gid in self._groups_posted or meta is None or self._transfer is None:
            return
        self._groups_posted.add(gid)
        ops = meta.saves_of_group(gid)
        if not ops:
            return
        failed = self._peers.tainted_now()
        group = self._layout.group(gid)
        batch: list[tuple[int, Any, list[Any]]] = []
        for rid, op in ops:
            if rid in failed:
                self._suppressed += 1
            elif self._windows[gid] is not None:  # the cache may reuse this page before the save reads it: a copy
                segments, page_ready = streams.snapshot(page_segments(group, op.page_slot), stream, self._device)
                self._saves.setdefault(rid, []).append(self.service.save(gid, op.key, op.parent_key, segments, ready=page_ready))
            else:
                batch.append((rid, op, page_segments(group, op.page_slot)))
        if batch:  # the layers' KV must be in memory before the transfer threads read it
            ready = streams.record_ready(stream, [self._device])
            futures = self.service.save_many(gid, [(op.key, op.parent_key, s) for _, op, s in batch], ready=ready)
            for (rid, _, _), fut in zip(batch, futures):
                self._saves.setdefault(rid, []).append(fut)

