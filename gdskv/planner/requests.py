"""A request's planning state (``RequestState``): its keys, its page slots per layer group, what
it loads and what it has saved, advanced by ``plan_step`` for every step it is in, and by
``take_promised_loads`` for engines that load before its first step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from gdskv.keys import chain_keys, plain_ints
from gdskv.layout import valid_page_slots
from gdskv.planner.lookup import Lookup, first_live_block, window_blocks, window_keep_from
from gdskv.planner.wire import PageOp, RequestPlan, Salt, StepReport, StoredFn


@dataclass
class RequestState:
    """What the scheduler knows about one request between steps.

    Created by ``new_request`` at the lookup (or at the request's first report when no lookup
    happened), updated by ``record_alloc`` and ``plan_step``, dropped at ``request_finished``.
    """

    request_id: int
    tokens_per_block: int
    num_groups: int
    cache_salt: Salt = None
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    pages: list[dict[int, int]] = field(init=False)
    """Per layer group: block ordinal -> page slot, only ever filled through ``valid_page_slots``."""
    reported_blocks: list[int] = field(init=False)
    """Per layer group: block ordinals covered by the reports so far (where the next delta starts)."""
    promised: tuple[int, int] = (0, 0)
    """Block ordinals ``[first, end)`` the lookup promised; loaded on the first report."""
    loaded: tuple[int, int] = (0, 0)
    """Block ordinals ``[first, end)`` an asynchronous load took from the promise
    (``take_promised_loads``): found in the store by the lookup, so the first report does not ask
    the store about those it says are computed (a 32k-token prefix: 512 presence checks)."""
    decided: list[int] = field(init=False)
    """Per layer group: every ordinal below this was saved, skipped or found unsaveable."""
    kv_end: int = 0
    """Tokens whose KV the last planned step left in the pages."""
    reported: bool = False
    saves_planned: int = 0

    def __post_init__(self) -> None:
        self.pages = [{} for _ in range(self.num_groups)]
        self.reported_blocks = [0] * self.num_groups
        self.decided = [0] * self.num_groups

    # -- tokens and keys -------------------------------------------------------------------
    def set_tokens(self, tokens: Sequence[int]) -> None:
        """Replace the token list (a first report restates everything) and rekey if it changed."""
        if type(tokens) is list and tokens == self.tokens:  # the lookup's prompt, restated by the first report
            return
        tokens = _int_list(tokens)
        if tokens[: len(self.tokens)] != self.tokens:
            self.keys = []
        self.tokens = tokens
        self._extend_keys()

    def adopt_salt(self, cache_salt: Salt) -> None:
        """Take the salt a first report carries when the lookup saw none (a runtime whose request
        object does not expose it): every key from here on is salted with it."""
        if cache_salt is not None and cache_salt != self.cache_salt:
            self.cache_salt = cache_salt
            self.keys = []
            self._extend_keys()

    def extend_tokens(self, new_tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in new_tokens)
        self._extend_keys()

    def _extend_keys(self) -> None:
        start = len(self.keys)
        parent = self.keys[-1] if self.keys else None
        self.keys.extend(chain_keys(self.tokens, self.tokens_per_block, self.cache_salt, start=start, parent=parent))

    def parent_of(self, ordinal: int) -> Optional[bytes]:
        return self.keys[ordinal - 1] if ordinal > 0 else None

    def op(self, layer_group_id: int, ordinal: int) -> PageOp:
        """The transfer of block ``ordinal`` in a layer group: its page there, its key, its parent's
        key. Only for ordinals with a page (``ordinal in self.pages[layer_group_id]``)."""
        return PageOp(layer_group_id, self.pages[layer_group_id][ordinal], self.keys[ordinal], self.parent_of(ordinal))

    # -- pages ---------------------------------------------------------------------------------
    def apply_pages(self, layer_group_id: int, first_ordinal: int, page_indices: Sequence[int]) -> None:
        """Record ``page_indices[i]`` as the page of ordinal ``first_ordinal + i`` in a group.

        Entries that address a page (per ``valid_page_slots``) set it; the others (``-1``)
        remove whatever page the ordinal had, since the cache no longer holds it.
        """
        pages = self.pages[layer_group_id]
        valid = dict(valid_page_slots(page_indices))
        for i in range(len(page_indices)):
            if i in valid:
                pages[first_ordinal + i] = valid[i]
            else:
                pages.pop(first_ordinal + i, None)

    def record_alloc(self, block_ids_by_group: Sequence[Sequence[int]]) -> None:
        """``update_state_after_alloc(_by_layer_group)``: pages of the first chunk, from ordinal 0.

        Does not move ``reported_blocks``: the request's first report restates these ordinals.
        """
        self._check_groups(block_ids_by_group)
        for g, ids in enumerate(block_ids_by_group):
            self.apply_pages(g, 0, ids)

    def record_report(self, report: StepReport, first: bool) -> None:
        """Fold one step's deltas in: tokens, and pages per group (from ordinal 0 on a first report,
        after the previously reported ordinals otherwise)."""
        if first:
            self.set_tokens(report.new_tokens)
            self.reported_blocks = [0] * self.num_groups
        else:
            self.extend_tokens(report.new_tokens)
        self._check_groups(report.new_block_ids_by_group)
        for g, ids in enumerate(report.new_block_ids_by_group):
            self.apply_pages(g, self.reported_blocks[g], ids)
            self.reported_blocks[g] += len(ids)
        self.reported = True

    def rewind(self, position: int) -> None:
        """The engine discarded KV from ``position`` on (it recomputes after a failed load): the
        promised prefix is no longer loaded, and blocks from there on are undecided again."""
        self.promised = self.loaded = (0, 0)
        self.decided = [min(d, position // self.tokens_per_block) for d in self.decided]
        self.kv_end = position

    def forget_before(self, layer_group_id: int, ordinal: int) -> None:
        """Drop pages of ordinals below ``ordinal``: the window has passed them and the cache may
        hand their slots to other blocks without telling us."""
        pages = self.pages[layer_group_id]
        for o in [o for o in pages if o < ordinal]:
            del pages[o]

    def _check_groups(self, lists: Sequence[Sequence[int]]) -> None:
        if len(lists) > self.num_groups:
            raise ValueError(f"request {self.request_id}: page lists for {len(lists)} layer groups, the layout has {self.num_groups}")


def _int_list(tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a new list of plain ints (checking a list's element types costs a fraction
    of converting each: ``gdskv.keys.plain_ints``)."""
    if type(tokens) is list and plain_ints(tokens):
        return list(tokens)
    return list(map(int, tokens))


def new_request(
    request_id: int,
    tokens: Sequence[int],
    cache_salt: Salt,
    tokens_per_block: int,
    num_groups: int,
    lookup: Optional[Lookup] = None,
) -> RequestState:
    """Fresh state for a request (at its lookup, or at a first report without one).

    ``lookup`` is ``plan_lookup``'s answer for these ``tokens`` and ``cache_salt``: its keys are
    taken as they are, so the prompt is hashed once per lookup, not twice.
    """
    state = RequestState(request_id, tokens_per_block, num_groups, cache_salt)
    if lookup is not None:
        blocks = len(tokens) // tokens_per_block
        if len(lookup.keys) != blocks:
            raise ValueError(f"request {request_id}: the lookup keyed {len(lookup.keys)} blocks, the tokens have {blocks}")
        state.keys = list(lookup.keys)
        if lookup.end_block > lookup.first_block:
            state.promised = (lookup.first_block, lookup.end_block)
    state.set_tokens(tokens)
    return state


def plan_step(
    state: RequestState,
    report: StepReport,
    first: bool,
    windows: Sequence[Optional[int]],
    stored: StoredFn,
    window_aware: bool = False,
) -> RequestPlan:
    """Fold a step's report into ``state`` and plan its loads and saves.

    With ``window_aware`` (the lookup was ``plan_lookup_window_aware``) a sliding group loads only
    the promised blocks inside its window before the promise's end (``window_blocks``), and saves
    the blocks this step completes from ``window_keep_from`` on, whether or not the window has
    passed them by the end of the step (their pages are still held during it).

    ``first`` is whether the report came in ``new_requests``. ``windows[g]`` is layer group
    ``g``'s attention window (``None`` = full attention).

    The KV that exists at the end of the step is taken as ``computed_position +
    num_scheduled_tokens`` (TensorRT-LLM leaves a synchronous offer out of a first report's
    ``computed_position``; its adapter adds it back, ``GdsKvScheduler._plan``). A later report whose
    ``computed_position`` is behind that end means the engine threw KV away and recomputes it
    (the reference engine does after a failed load): planning rewinds to that position.
    """
    if not first and report.computed_position < state.kv_end:
        state.rewind(report.computed_position)
    state.record_report(report, first)
    tpb = state.tokens_per_block
    known = (0, 0)
    if first:  # blocks loaded ahead that the engine says are computed: in the store, not asked again
        known = (state.loaded[0], min(state.loaded[1], report.computed_position // tpb))
        state.loaded = (0, 0)
    loads: dict[int, tuple[PageOp, ...]] = {}
    if first and state.promised[1] > state.promised[0]:
        loads = _plan_loads(state, windows if window_aware else None)  # under the keys the lookup found them by
    if first:
        state.adopt_salt(report.cache_salt)
    end = min(report.computed_position + report.num_scheduled_tokens, len(state.tokens))
    state.kv_end = end
    live_from = [first_live_block(end, w, tpb) for w in windows]
    save_from = [window_keep_from(len(state.tokens), w, tpb) for w in windows] if window_aware else live_from
    saves = _plan_saves(state, end // tpb, save_from, stored, known)
    for g, first_live in enumerate(live_from):
        if first_live:  # 0 for full attention: nothing to forget
            state.forget_before(g, first_live)
    return RequestPlan(report.request_id, loads, saves)


def _plan_loads(state: RequestState, windows: Optional[Sequence[Optional[int]]] = None) -> dict[int, tuple[PageOp, ...]]:
    """Loads of the promised blocks into the pages known now, per group; blocks a group has no
    page for are not needed by the engine there. (``_plan_saves`` never saves a promised block.)
    With ``windows`` (window-aware serving) a group loads only ``window_blocks`` of the promise."""
    first, end = state.promised
    loads = {}
    for g in range(state.num_groups):
        wanted = range(first, end) if windows is None else window_blocks(end, windows[g], state.tokens_per_block, first)
        ops = tuple(state.op(g, o) for o in wanted if o in state.pages[g])
        if ops:
            loads[g] = ops
    return loads


def _plan_saves(state: RequestState, complete: int, live_from: Sequence[int], stored: StoredFn,
                known: tuple[int, int] = (0, 0)) -> dict[int, tuple[PageOp, ...]]:
    """Saves of blocks that are complete (ordinal < ``complete``), have a page, lie in the live
    window (ordinal >= ``live_from[g]``), are neither promised nor ``known`` to be stored (block
    ordinals ``[first, end)``) and are not in the store; every ordinal below ``complete`` is
    decided afterwards, so none is considered twice."""
    p_first, p_end = state.promised
    k_first, k_end = known
    saves = {}
    for g in range(state.num_groups):
        start = state.decided[g]
        candidates = [
            o for o in range(max(start, live_from[g]), complete)
            if o in state.pages[g] and not p_first <= o < p_end and not k_first <= o < k_end
        ]
        state.decided[g] = max(start, complete)
        if not candidates:
            continue
        present = stored(g, [state.keys[o] for o in candidates])
        ops = tuple(state.op(g, o) for o, there in zip(candidates, present) if not there)
        if ops:
            saves[g] = ops
            state.saves_planned += len(ops)
    return saves


def take_promised_loads(state: RequestState, block_ids_by_group: Sequence[Sequence[int]], num_tokens: int) -> dict[int, tuple[PageOp, ...]]:
    """For an engine that loads a request's promised prefix before the request's first step
    (vLLM's asynchronous loads): record the pages allocated for it and return the loads of the
    promised blocks the engine accepted (``num_tokens`` from the first promised block, whole
    blocks only), per layer group. The promise is then spent: the first report plans no loads
    again, and a block whose load fails is saved again once the engine has recomputed it (a block
    that loaded is in the store, so it is not saved twice, nor asked about again: ``loaded``)."""
    state.record_alloc(block_ids_by_group)
    first, end = state.promised
    state.promised = (first, min(end, first + max(0, num_tokens) // state.tokens_per_block))
    loads = _plan_loads(state)
    state.loaded, state.promised = state.promised, (0, 0)
    return loads
