"""The scheduler role of the vLLM connector (vLLM's EngineCore process): lookups, per-request
state, and each step's ``StepMeta``. No vLLM import; every decision is ``gdskv.planner``'s, every
store access ``gdskv.service.KvService``'s (a lookup-only service: this process moves no pages).

Flow per request, as vLLM 0.32 calls it:

1. ``matched`` (``get_num_new_matched_tokens``): the service's leased lookup of the request's
   tokens (salted with ``cache_salt``) beyond the device's prefix; whole blocks, never the last
   token; a hit is loaded asynchronously (``load_async=True``).
2. ``allocated`` (``update_state_after_alloc``): the blocks vLLM allocated for the hit; their
   loads go into the next ``StepMeta``; the workers report the request in ``finished_recving``
   once they are done (failed blocks through ``get_block_ids_with_load_errors``).
3. ``build_meta`` (every step): each scheduled request's report goes through
   ``planner.plan_step``, which saves every block as soon as its tokens are computed.
4. ``finished`` (``request_finished``, also for an aborted request): the blocks stay allocated
   (True) while saves planned for the request may still be reading them; the workers report it
   in ``finished_sending``.

Per-request state lives in ``RequestTable``s: dropped at finish, abort and preemption, and, for a
request looked up but never scheduled, after ``unscheduled_ttl_s`` (default ``LEASE_SECONDS``;
``build_meta`` expires them).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from gdskv.planner import RequestState, StepReport, new_request, plan_step, take_promised_loads
from gdskv.request_state import RequestTable
from gdskv.service import LEASE_SECONDS, KvService
from gdskv.connectors.vllm.translate import StepMeta, block_ids_of, tokens_of

log = logging.getLogger(__name__)


class SchedulerSide:
    """State of the scheduler role; ``service`` checks every TP shard's namespace."""

    def __init__(self, service: KvService, unscheduled_ttl_s: float = LEASE_SECONDS):
        self.service = service
        self.tokens_per_block = service.tokens_per_block
        self.windows = list(service.windows)
        self._states: RequestTable[str, RequestState] = RequestTable(unscheduled_ttl_s)
        self._requests: RequestTable[str, Any] = RequestTable(unscheduled_ttl_s)
        """vLLM's ``Request`` objects of live requests (their tokens grow as they decode)."""
        self._loads: list[tuple[str, tuple]] = []
        self._held: list[str] = []
        self._step = 0

    # -- get_num_new_matched_tokens / update_state_after_alloc ---------------------------------
    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = tokens_of(request)
        rid = str(request.request_id)
        if tokens is None or not self.service.active:
            return 0, False
        salt = getattr(request, "cache_salt", None)
        found = self.service.lookup(tokens, salt, num_computed_tokens)
        self._states.put(rid, new_request(rid, tokens, salt, self.tokens_per_block, len(self.windows), found))
        self._requests.put(rid, request)
        n = found.num_new_tokens
        return n, n > 0

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = str(request.request_id)
        self._requests.put(rid, request, scheduled=True)  # blocks allocated: it runs, or is finished
        self._states.mark_scheduled(rid)
        state = self._states.get(rid)
        if state is None:
            return
        # the hit vLLM accepted (maybe less than offered, maybe none): its loads, and the promise spent
        loads = take_promised_loads(state, block_ids_of(blocks), max(0, num_external_tokens))
        ops = tuple(op for g in sorted(loads) for op in loads[g])
        if ops:
            self._loads.append((rid, ops))

    # -- build_connector_meta ----------------------------------------------------------------------
    def build_meta(self, out: Any) -> StepMeta:
        self._step += 1
        self._states.expire()
        self._requests.expire()
        preempted = tuple(str(r) for r in (getattr(out, "preempted_req_ids", None) or ()))
        for rid in preempted:  # its blocks are freed; a later lookup starts it afresh
            self._states.pop(rid)
        meta = StepMeta(step=self._step, loads=self._loads, held=tuple(self._held), preempted=preempted)
        self._loads, self._held = [], []
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            rid = str(new.req_id)
            tokens = self._tokens(rid, new.prompt_token_ids)
            self._report(meta, rid, tokens, block_ids_of(new.block_ids), new.num_computed_tokens, scheduled.get(rid, 0), True)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            rid = str(rid)
            first = rid in cached.resumed_req_ids
            ids = block_ids_of(cached.new_block_ids[i]) if cached.new_block_ids[i] is not None else [[] for _ in self.windows]
            tokens = self._tokens(rid, (cached.all_token_ids or {}).get(rid))
            self._report(meta, rid, tokens, ids, cached.num_computed_tokens[i], scheduled.get(rid, 0), first)
        self.service.flush_stats()
        return meta

    def _tokens(self, rid: str, fallback: Optional[list[int]]) -> Optional[list[int]]:
        request = self._requests.get(rid)
        tokens = tokens_of(request) if request is not None else None
        return tokens if tokens is not None else (list(fallback) if fallback is not None else None)

    def _report(self, meta: StepMeta, rid: str, tokens: Optional[list[int]], block_ids: list[list[int]], computed: int,
                scheduled: int, first: bool) -> None:
        if tokens is None or not self.service.active:
            return
        state = self._states.get(rid)
        if first and (state is None or state.reported):
            state = new_request(rid, tokens, self._salt(rid), self.tokens_per_block, len(self.windows))
            self._states.put(rid, state, scheduled=True)
        if state is None:
            return
        self._states.mark_scheduled(rid)
        self._requests.mark_scheduled(rid)
        new_tokens = tokens if first else tokens[len(state.tokens):]
        report = StepReport(rid, new_tokens, block_ids, int(computed), int(scheduled), state.cache_salt)
        plan = plan_step(state, report, first, self.windows, self.service.stored)
        ops = tuple(op for g in sorted(plan.saves) for op in plan.saves[g])
        if ops:
            meta.saves.append((rid, ops))

    def _salt(self, rid: str) -> Any:
        request = self._requests.get(rid)
        return getattr(request, "cache_salt", None) if request is not None else None

    @property
    def tracked(self) -> int:
        """Entries in the per-request maps (the leak checks read it)."""
        return len(self._states) + len(self._requests)

    # -- request_finished --------------------------------------------------------------------------
    def finished(self, request: Any) -> bool:
        """True (keep the blocks) when saves were planned for the request: the workers report it
        in ``finished_sending`` once every one of them is done."""
        rid = str(request.request_id)
        state = self._states.pop(rid)
        self._requests.pop(rid)
        hold = state is not None and state.saves_planned > 0
        if hold:
            self._held.append(rid)
        return hold
