"""``GdsKvScheduler``: the leader half of the TensorRT-LLM connector, on ``gdskv.service.KvService``.

It translates TensorRT-LLM's scheduler callbacks and types (``LlmRequest``, ``RequestData``,
``SchedulerOutput``) onto the service (lookups with cross-process leases, every TP shard's
namespace, counters) and ``gdskv.planner`` (per-request state, what to load and save in each
step). Its service only looks up (``transfers=False``): this half never touches pages.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from gdskv.config import GdsKvConfig, load_config
from gdskv.connectors.trtllm.base import KvCacheConnectorScheduler
from gdskv.connectors.trtllm.deployment import Deployment, peers
from gdskv.planner import (ConnectorMetadata, RequestPlan, RequestState, StepReport, loads_async, new_request, plan_step,
                           take_promised_loads)
from gdskv.request_state import RequestTable
from gdskv.service import LEASE_SECONDS, KvService, ServiceSetupError
from gdskv.store.taints import deployment_nonce

log = logging.getLogger(__name__)

LOOKUP_LEASE_SECONDS = LEASE_SECONDS
"""How long a lookup's served chunks are leased against eviction (any process's) so the load that
follows finds them: TensorRT-LLM cannot recompute a request whose promised load fails."""


@dataclass(frozen=True)
class StepMetadata(ConnectorMetadata):
    """``ConnectorMetadata`` plus the requests whose loads in this step are asynchronous: the
    workers post them and never wait for them in the forward pass (the request is not in it);
    ``get_finished`` reports them once every page landed."""

    async_loads: frozenset[int] = field(default_factory=frozenset)
    deployment: str = ""
    """The scheduler's id (``gdskv.store.taints``): ranks in other processes tell each other of a
    failed load under it."""


@dataclass
class Tracked:
    """What the scheduler keeps per request: the planner's state, and whether its load was
    promised asynchronously (``get_num_new_matched_tokens`` answered ``is_async=True``)."""

    state: RequestState
    load_async: bool = False
    offered: int = 0
    """The tokens ``get_num_new_matched_tokens`` offered: TensorRT-LLM leaves a synchronous
    offer out of the request's first ``computed_position``, which ``_plan`` adds back."""


@dataclass
class SchedulerCounters:
    """Hit/miss counters of the scheduler (lookups and what it planned)."""

    lookups: int = 0
    lookup_tokens: int = 0
    """Prompt tokens asked about."""
    matched_tokens: int = 0
    """Tokens ``get_num_new_matched_tokens`` offered."""
    loads_planned: int = 0
    saves_planned: int = 0
    store_errors: int = 0
    async_loads: int = 0
    """Requests whose load was promised asynchronously."""


class GdsKvScheduler(KvCacheConnectorScheduler):
    """The leader half: lookups, per-request state, and the metadata each step's workers execute.

    Constructed once on rank 0 by the runtime as ``GdsKvScheduler(llm_args)``. Inactive (serving
    nothing, saving nothing, with one log line) until a worker of this process has registered a
    layout, or when the store cannot be opened.
    """

    def __init__(self, llm_args: Any, config: Optional[GdsKvConfig] = None, unscheduled_ttl_s: float = LOOKUP_LEASE_SECONDS):
        """TensorRT-LLM constructs it with ``llm_args`` alone (gdskv's settings then come from
        ``load_config()``); in-process callers (the reference engine's stacks) pass ``config``.
        ``unscheduled_ttl_s``: how long a looked-up request may go unscheduled before its state is
        dropped (``gdskv.request_state``)."""
        super().__init__(llm_args)
        self._cfg = config if config is not None else load_config()
        self._deployment = Deployment.from_llm_args(llm_args, self._cfg)
        self._peers = peers(self._cfg.store_path, self._deployment.model, self._deployment.tp_size)
        self._nonce = deployment_nonce()
        self.service: Optional[KvService] = None
        """Built once a worker of this process has registered (its spec names the namespaces)."""
        self._requests: RequestTable[int, Tracked] = RequestTable(unscheduled_ttl_s)
        """Every request between its lookup (or first report) and ``request_finished``; a request
        looked up and never scheduled is dropped after ``unscheduled_ttl_s``."""
        self._async_plans: list[RequestPlan] = []
        """Asynchronous loads planned at ``update_state_after_alloc``, sent in the next step's metadata."""
        self._step = 0
        self._warned_inactive = False
        self._planned = SchedulerCounters()
        """What this half counts itself (plans, store errors); lookups are the service's."""

    @property
    def counters(self) -> SchedulerCounters:
        """A snapshot: the service's lookup counters and this half's planning counters."""
        done = self.service.snapshot() if self.service is not None else {}
        return SchedulerCounters(done.get("lookups", 0), done.get("lookup_tokens", 0), done.get("matched_tokens", 0),
                                 self._planned.loads_planned, self._planned.saves_planned, self._planned.store_errors,
                                 self._planned.async_loads)

    @property
    def tracked(self) -> int:
        """How many requests the scheduler holds state for (the leak checks read it)."""
        return len(self._requests)

    # -- store --------------------------------------------------------------------------------
    def _resolve(self) -> bool:
        """Bring the service up (once a worker has registered); False while it cannot serve."""
        if self.service is not None:
            return self.service.active
        spec = self._peers.leader_spec()
        if spec is None:
            self._inactive("no connector worker has registered a KV cache layout in this process yet; serving nothing")
            return False
        try:
            self.service = KvService(self._cfg, spec, transfers=False, lease_seconds=LOOKUP_LEASE_SECONDS,
                                     served_by="trtllm")
        except ServiceSetupError as e:  # the worker refused this store at registration already
            self._planned.store_errors += 1
            self._inactive(f"{e}; serving nothing")
            return False
        if not self.service.active:  # the service logged why
            self._planned.store_errors += 1
        return self.service.active

    def _inactive(self, why: str) -> None:
        if not self._warned_inactive:
            log.warning("gdskv: %s", why)
            self._warned_inactive = True

    # -- callbacks ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Called once per KV allocation of ``request``: prompt tokens the store serves beyond the
        ``num_computed_tokens`` the device holds (leased until the load), and whether they load
        asynchronously: when the load is at least ``async_load_min_bytes`` per rank (and serving
        is not window-aware), the request waits outside the batch until ``get_finished`` reports
        its pages in place, so no other request's step waits for the disk. Never ``(0, True)``."""
        if not self._resolve():
            return 0, False
        self._requests.expire()
        rid = int(request.request_id)
        tokens = list(request.get_tokens(0))
        salt = getattr(request, "cache_salt", None)
        found = self.service.lookup(tokens, salt, num_computed_tokens, window_aware=self._cfg.window_aware)
        load_async = loads_async(found, sum(self.service.bytes_per_page(g) for g in self.service.group_ids),
                                 self._cfg.async_load_min_bytes, self._cfg.window_aware)
        state = new_request(rid, tokens, salt, self.service.tokens_per_block, len(self.service.windows), found)
        self._requests.put(rid, Tracked(state, load_async, found.num_new_tokens))
        self._planned.async_loads += load_async
        log.debug("gdskv: request %d: %d of %d prompt tokens from the store%s", rid, found.num_new_tokens, len(tokens),
                  " (asynchronous load)" if load_async else "")
        return found.num_new_tokens, load_async

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Flat form (single layer group): pages of the first chunk."""
        self.update_state_after_alloc_by_layer_group(request, [block_ids])

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        """Called after the lookup, once pages exist for the promised prefix and the first chunk.
        An asynchronous load is planned here, into these pages, and sent with the next step's
        metadata (TensorRT-LLM leaves a loading request out of the scheduler output)."""
        tracked = self._requests.get(int(request.request_id))
        if tracked is None:
            return
        self._requests.mark_scheduled(int(request.request_id))  # pages allocated: it runs, or is finished
        state = tracked.state
        if not tracked.load_async:
            state.record_alloc(block_ids_by_layer_group)
            return
        first, end = state.promised
        loads = take_promised_loads(state, block_ids_by_layer_group, (end - first) * state.tokens_per_block)
        if any(loads.values()):
            self._async_plans.append(RequestPlan(state.request_id, loads))
            self._planned.loads_planned += sum(len(ops) for ops in loads.values())

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Called every step before the forward pass: the asynchronous loads planned since the last
        step, then loads (a request's first report) and saves (blocks this step completes) from
        both ``new_requests`` and ``cached_requests``. Drops requests looked up and never scheduled."""
        self._step += 1
        self._requests.expire()
        async_plans, self._async_plans = self._async_plans, []
        if not self._resolve():
            return StepMetadata(step=self._step, deployment=self._nonce)
        self.service.flush_stats()
        plans: list[RequestPlan] = list(async_plans)
        for first, entries in ((True, scheduler_output.new_requests), (False, scheduler_output.cached_requests)):
            for data in entries:
                plan = self._plan(data, first)
                if plan is not None and not plan.empty:
                    plans.append(plan)
        return StepMetadata(tuple(plans), step=self._step, async_loads=frozenset(p.request_id for p in async_plans),
                            deployment=self._nonce)

    def _plan(self, data: Any, first: bool) -> Optional[RequestPlan]:
        """One ``RequestData`` of ``build_connector_meta`` through ``plan_step``. A first report
        without a lookup (or of a replayed request) starts fresh state; a cached entry without
        any state is not planned."""
        report = report_of(data)
        tracked = self._requests.get(report.request_id)
        if first and (tracked is None or tracked.state.reported):
            tracked = Tracked(new_request(report.request_id, report.new_tokens, report.cache_salt, self.service.tokens_per_block,
                                          len(self.service.windows)))
            self._requests.put(report.request_id, tracked, scheduled=True)
        if tracked is None:
            log.debug("gdskv: request %d reported as cached without a first report; not planned", report.request_id)
            return None
        self._requests.mark_scheduled(report.request_id)
        if first and not tracked.load_async and tracked.offered:  # the KV before the step includes the offer
            report = replace(report, computed_position=report.computed_position + tracked.offered)
        plan = plan_step(tracked.state, report, first, self.service.windows, self.service.stored, window_aware=self._cfg.window_aware)
        self._planned.loads_planned += sum(len(ops) for ops in plan.loads.values())
        self._planned.saves_planned += sum(len(ops) for ops in plan.saves.values())
        return plan

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Flat form of ``request_finished_by_layer_group``."""
        return self.request_finished_by_layer_group(request, [cache_block_ids])

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Called when ``request`` completes (or is aborted). Nothing is saved here (every block was
        planned when it completed); returns True when saves were planned for it, so its pages stay
        allocated until every worker reports the request in ``get_finished``. Also True for a
        request aborted while its asynchronous load may still be writing its pages."""
        rid = int(request.request_id)
        self._async_plans = [p for p in self._async_plans if p.request_id != rid]
        self._peers.finished(rid, settled=False)  # it computes nothing more: a taint of it has nothing left to stop
        tracked = self._requests.pop(rid)
        if tracked is None:
            return False
        return tracked.state.saves_planned > 0 or (tracked.load_async and not tracked.state.reported)


def report_of(data: Any) -> StepReport:
    """A ``RequestData`` (TensorRT-LLM's or the reference engine's, duck-typed) as a ``StepReport``;
    the flat ``new_block_ids`` stands in for group 0 where the per-group lists are absent."""
    by_group = getattr(data, "new_block_ids_by_layer_group", None) or [list(getattr(data, "new_block_ids", None) or [])]
    return StepReport(
        request_id=int(data.request_id),
        new_tokens=list(data.new_tokens or ()),
        new_block_ids_by_group=[list(ids) for ids in by_group],
        computed_position=int(data.computed_position),
        num_scheduled_tokens=int(data.num_scheduled_tokens),
        cache_salt=getattr(data, "cache_salt", None),
    )
