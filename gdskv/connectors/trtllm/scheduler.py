"""``GdsKvScheduler``: the leader half of the TensorRT-LLM connector, on ``gdskv.service.KvService``.

It translates TensorRT-LLM's scheduler callbacks and types (``LlmRequest``, ``RequestData``,
``SchedulerOutput``) onto the service (lookups with cross-process leases, every TP shard's
namespace, counters) and ``gdskv.planner`` (per-request state, what to load and save in each
step). Its service only looks up (``transfers=False``): this half never touches pages.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from gdskv.config import GdsKvConfig, load_config
from gdskv.connectors.trtllm.base import KvCacheConnectorScheduler
from gdskv.connectors.trtllm.deployment import Deployment, peers
from gdskv.planner import ConnectorMetadata, RequestPlan, RequestState, StepReport, new_request, plan_step
from gdskv.service import LEASE_SECONDS, KvService, ServiceSetupError

log = logging.getLogger(__name__)

LOOKUP_LEASE_SECONDS = LEASE_SECONDS
"""How long a lookup's served chunks are leased against eviction (any process's) so the load that
follows finds them: TensorRT-LLM cannot recompute a request whose promised load fails."""


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


class GdsKvScheduler(KvCacheConnectorScheduler):
    """The leader half: lookups, per-request state, and the metadata each step's workers execute.

    Constructed once on rank 0 by the runtime as ``GdsKvScheduler(llm_args)``. Inactive (serving
    nothing, saving nothing, with one log line) until a worker of this process has registered a
    layout, or when the store cannot be opened.
    """

    def __init__(self, llm_args: Any, config: Optional[GdsKvConfig] = None):
        """TensorRT-LLM constructs it with ``llm_args`` alone (gdskv's settings then come from
        ``load_config()``); in-process callers (the reference engine's stacks) pass ``config``."""
        super().__init__(llm_args)
        self._cfg = config if config is not None else load_config()
        self._deployment = Deployment.from_llm_args(llm_args, self._cfg)
        self._peers = peers(self._cfg.store_path, self._deployment.model, self._deployment.tp_size)
        self.service: Optional[KvService] = None
        """Built once a worker of this process has registered (its spec names the namespaces)."""
        self._requests: dict[int, RequestState] = {}
        self._step = 0
        self._warned_inactive = False
        self._planned = SchedulerCounters()
        """What this half counts itself (plans, store errors); lookups are the service's."""

    @property
    def counters(self) -> SchedulerCounters:
        """A snapshot: the service's lookup counters and this half's planning counters."""
        done = self.service.snapshot() if self.service is not None else {}
        return SchedulerCounters(done.get("lookups", 0), done.get("lookup_tokens", 0), done.get("matched_tokens", 0),
                                 self._planned.loads_planned, self._planned.saves_planned, self._planned.store_errors)

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
            self.service = KvService(self._cfg, spec, transfers=False, lease_seconds=LOOKUP_LEASE_SECONDS)
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
        ``num_computed_tokens`` the device holds (leased until the load). Loads are synchronous
        with the forward pass (posted in ``start_load_kv``, awaited per layer), so the answer is
        never asynchronous, and never ``(0, True)``."""
        if not self._resolve():
            return 0, False
        rid = int(request.request_id)
        tokens = list(request.get_tokens(0))
        salt = getattr(request, "cache_salt", None)
        found = self.service.lookup(tokens, salt, num_computed_tokens, window_aware=self._cfg.window_aware)
        self._requests[rid] = new_request(rid, tokens, salt, self.service.tokens_per_block, len(self.service.windows), found)
        log.debug("gdskv: request %d: %d of %d prompt tokens from the store", rid, found.num_new_tokens, len(tokens))
        return found.num_new_tokens, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Flat form (single layer group): pages of the first chunk."""
        self.update_state_after_alloc_by_layer_group(request, [block_ids])

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        """Called after the lookup, once pages exist for the promised prefix and the first chunk."""
        state = self._requests.get(int(request.request_id))
        if state is not None:
            state.record_alloc(block_ids_by_layer_group)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Called every step before the forward pass: plan loads (a request's first report) and
        saves (blocks this step completes) from both ``new_requests`` and ``cached_requests``."""
        self._step += 1
        if not self._resolve():
            return ConnectorMetadata(step=self._step)
        self.service.flush_stats()
        plans: list[RequestPlan] = []
        for first, entries in ((True, scheduler_output.new_requests), (False, scheduler_output.cached_requests)):
            for data in entries:
                plan = self._plan(data, first)
                if plan is not None and not plan.empty:
                    plans.append(plan)
        return ConnectorMetadata(tuple(plans), step=self._step)

    def _plan(self, data: Any, first: bool) -> Optional[RequestPlan]:
        """One ``RequestData`` of ``build_connector_meta`` through ``plan_step``. A first report
        without a lookup (or of a replayed request) starts fresh state; a cached entry without
        any state is not planned."""
        report = report_of(data)
        state = self._requests.get(report.request_id)
        if first and (state is None or state.reported):
            state = new_request(report.request_id, report.new_tokens, report.cache_salt, self.service.tokens_per_block,
                                len(self.service.windows))
            self._requests[report.request_id] = state
        if state is None:
            log.debug("gdskv: request %d reported as cached without a first report; not planned", report.request_id)
            return None
        plan = plan_step(state, report, first, self.service.windows, self.service.stored, window_aware=self._cfg.window_aware)
        self._planned.loads_planned += sum(len(ops) for ops in plan.loads.values())
        self._planned.saves_planned += sum(len(ops) for ops in plan.saves.values())
        return plan

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Flat form of ``request_finished_by_layer_group``."""
        return self.request_finished_by_layer_group(request, [cache_block_ids])

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Called when ``request`` completes. Nothing is saved here (every block was planned when it
        completed); returns True when saves were planned for it, so its pages stay allocated until
        every worker reports the request in ``get_finished``."""
        state = self._requests.pop(int(request.request_id), None)
        return state is not None and state.saves_planned > 0


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
