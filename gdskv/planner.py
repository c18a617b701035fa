"""Engine-agnostic planning: what a request can be served from the store, and what to save when.

Everything here is pure logic over plain data (token lists, page-slot lists, booleans): no store,
no tensors, no engine types. A connector adapts its engine's callbacks onto these functions and
hands the store in as one predicate, ``stored(layer_group_id, keys) -> list[bool]`` ("is every
TP shard of this block present"), so the rules below are testable without any of it.

The rules (TensorRT-LLM KV Cache Connector spec, gdskv DESIGN.md):

- Keys: block ``i`` of a request is named by ``gdskv.keys.chain_keys`` over its tokens with the
  request's ``cache_salt`` mixed in. ``RequestData.block_hashes`` is never needed.
- Lookup: full blocks only, contiguous from the first block not already on the device; stop at
  the first block ordinal that any layer group (on any TP shard) misses, so the smallest window
  bounds the served prefix; never the whole prompt (at least one token is computed, so the
  engine has logits to sample from).
- Page slots: a request's ``block ordinal -> page slot`` map per layer group is built only
  through ``valid_page_slots``; ``-1`` never becomes a transfer target, and an ordinal reported
  as ``-1`` later drops its page. Every transfer target is ``(layer_group_id, page_slot)``.
- Loads: planned once, on the request's first report, into the pages known then.
- Saves: a block is planned for saving in the step whose forward pass completes its tokens,
  never deferred to ``request_finished``; each (group, ordinal) is decided at most once; a block
  already in the store, or just loaded from it, is not written again. Under a sliding window only
  blocks that lie entirely inside the live window at the end of the step are saved, so at most
  ``window_size`` tokens per sequence are persisted and no page the cache may reclaim is read.

Who calls what: ``gdskv.connectors.trtllm.GdsKvScheduler`` (and any other connector front end)
calls ``plan_lookup`` from ``get_num_new_matched_tokens``, ``RequestState.record_alloc`` from
``update_state_after_alloc(_by_layer_group)``, and ``plan_step`` for every entry of
``build_connector_meta``'s ``new_requests`` and ``cached_requests``; the resulting
``ConnectorMetadata`` is what the workers execute. An engine that names its blocks itself
(``gdskv.connectors.max``) asks ``held_everywhere`` what a lookup reports, ``store_shards`` /
``shard_routes`` where a leaf's chunks live and come from, and ``plan_offload`` what to write.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

from gdskv.keys import chain_keys, plain_ints
from gdskv.layout import valid_page_slots

Salt = Optional[str | bytes | int]
StoredFn = Callable[[int, Sequence[bytes]], list[bool]]
"""``stored(layer_group_id, keys)``: for each key, whether the store holds it (every TP shard)."""


# --- the metadata the workers execute -------------------------------------------------------

class PageOp(NamedTuple):
    """One page transfer: the page slot ``page_slot`` of layer group ``layer_group_id`` to or
    from the store chunk named ``key`` (``parent_key`` is the key of the block before it, or
    ``None`` for block 0; the store records it for prefix-aware eviction). A tuple: a 32k-token
    prefix is 512 of them, made in the step that admits the request (cheaper than a frozen
    dataclass) and sent to every rank as columns (``RequestPlan.__reduce__``)."""

    layer_group_id: int
    page_slot: int
    key: bytes
    parent_key: Optional[bytes]


@dataclass(frozen=True)
class RequestPlan:
    """One request's transfers for one step, per layer group id. Pickled (into the step's
    metadata, for every rank) as columns: see ``_ops_to_wire``."""

    request_id: int
    loads: dict[int, tuple[PageOp, ...]] = field(default_factory=dict)
    saves: dict[int, tuple[PageOp, ...]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not any(self.loads.values()) and not any(self.saves.values())

    def __reduce__(self) -> tuple:
        return _plan_from_wire, (self.request_id, {g: _ops_to_wire(ops) for g, ops in self.loads.items()},
                                 {g: _ops_to_wire(ops) for g, ops in self.saves.items()})


def _ops_to_wire(ops: tuple[PageOp, ...]) -> tuple:
    """One group's ops as pickle carries them. A restored 32k-token prefix is 512 ops in the
    step that admits it: pickled and unpickled one tuple each, the round trip was 1.0-1.7 ms of
    that step (on every rank); as columns (slots as int64 bytes, keys end to end, the parents as
    "each key's predecessor" where they chain, as a lookup's run does: one parent, the first
    op's) it is ~0.4 ms. Ops of mixed layer groups, or whose keys are not all bytes of one
    length, travel as they are."""
    keys = [op.key for op in ops]
    if (not ops or len({len(k) for k in keys}) != 1 or not all(type(k) is bytes for k in keys)
            or len({op.layer_group_id for op in ops}) != 1):
        return ("ops", ops)
    parents = [op.parent_key for op in ops]
    return ("cols", ops[0].layer_group_id, len(keys[0]), array("q", [op.page_slot for op in ops]).tobytes(),
            b"".join(keys), (parents[0],) if parents[1:] == keys[:-1] else tuple(parents))


def _ops_from_wire(wire: tuple) -> tuple[PageOp, ...]:
    if wire[0] == "ops":
        return wire[1]
    _, gid, size, slot_bytes, blob, parents = wire
    slots = array("q")
    slots.frombytes(slot_bytes)
    keys = [blob[at:at + size] for at in range(0, len(blob), size)]
    if len(parents) == 1:  # chained (one op is a chain of one)
        parents = [parents[0], *keys[:-1]]
    make = tuple.__new__  # PageOp's own __new__ is a Python function: a third of the cost
    return tuple([make(PageOp, op) for op in zip([gid] * len(keys), slots, keys, parents)])


def _plan_from_wire(request_id: int, loads: dict[int, tuple], saves: dict[int, tuple]) -> RequestPlan:
    return RequestPlan(request_id, {g: _ops_from_wire(w) for g, w in loads.items()},
                       {g: _ops_from_wire(w) for g, w in saves.items()})


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the scheduler's ``build_connector_meta`` returns for one step; picklable, broadcast to
    every TP rank's worker, bound there with ``bind_connector_meta``. ``step`` numbers the
    scheduler's steps, so a worker never executes the same metadata twice."""

    plans: tuple[RequestPlan, ...] = ()
    step: int = 0

    def loads_of_group(self, layer_group_id: int) -> list[tuple[int, PageOp]]:
        """``(request_id, op)`` for every load into layer group ``layer_group_id``."""
        return [(p.request_id, op) for p in self.plans for op in p.loads.get(layer_group_id, ())]

    def saves_of_group(self, layer_group_id: int) -> list[tuple[int, PageOp]]:
        """``(request_id, op)`` for every save from layer group ``layer_group_id``."""
        return [(p.request_id, op) for p in self.plans for op in p.saves.get(layer_group_id, ())]


# --- what an engine reports each step --------------------------------------------------------

@dataclass(frozen=True)
class StepReport:
    """One request's entry of a step, engine-neutral (built from TensorRT-LLM's ``RequestData``).

    ``new_tokens`` and ``new_block_ids_by_group[g]`` are deltas since the request's previous
    report (everything, on its first). ``computed_position`` counts tokens whose KV exists before
    this step (on a first report TensorRT-LLM leaves out the tokens the connector promised);
    ``num_scheduled_tokens`` is what this step's forward pass computes.
    """

    request_id: int
    new_tokens: Sequence[int]
    new_block_ids_by_group: Sequence[Sequence[int]]
    computed_position: int
    num_scheduled_tokens: int
    cache_salt: Salt = None


# --- pure helpers ------------------------------------------------------------------------------

def max_servable_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """Most full blocks that may be served for a prompt of ``num_tokens``: at least one token is
    left for the engine to compute, so never the whole prompt."""
    return max(0, (num_tokens - 1) // tokens_per_block)


def first_live_block(end: int, window: Optional[int], tokens_per_block: int) -> int:
    """First block ordinal lying entirely inside the live window once ``end`` tokens have KV.

    A query at position ``end`` attends to ``[end - window + 1, end]`` (itself included), so the
    pages it still needs hold positions ``>= end - window + 1``; a block is live when all of its
    tokens are. ``None`` (full attention) keeps every block live.
    """
    if window is None:
        return 0
    lo = end - window + 1
    return max(0, -(-lo // tokens_per_block))


def contiguous_hits(present: Sequence[Sequence[bool]], first: int = 0) -> int:
    """Length of the run of ordinals from ``first`` that every list in ``present`` holds.

    ``present[j][i]`` says whether holder ``j`` (a layer group on a TP shard) holds block
    ordinal ``first + i``; the run stops at the first ordinal any holder misses. Returns the
    ordinal one past the run (``first`` when nothing is held).
    """
    if len(present) == 1:  # one holder (the common case): a plain scan, no per-ordinal all()
        for i, held in enumerate(present[0]):
            if not held:
                return first + i
        return first + len(present[0])
    for i, held in enumerate(zip(*present)):
        if not all(held):
            return first + i
    return first + min((len(p) for p in present), default=0)


@dataclass(frozen=True)
class Lookup:
    """The answer to "how much of this prompt can the store serve": blocks ``[first_block,
    end_block)`` of ``keys``; ``num_new_tokens`` is what ``get_num_new_matched_tokens`` returns."""

    keys: tuple[bytes, ...]
    first_block: int
    end_block: int
    num_computed_tokens: int
    tokens_per_block: int

    @property
    def num_new_tokens(self) -> int:
        return max(0, self.end_block * self.tokens_per_block - self.num_computed_tokens)


def plan_lookup(
    tokens: Sequence[int],
    cache_salt: Salt,
    tokens_per_block: int,
    num_computed_tokens: int,
    num_groups: int,
    stored: StoredFn,
) -> Lookup:
    """Decide how many prompt tokens the store serves beyond the ``num_computed_tokens`` the
    engine already holds on the device.

    The device prefix is not looked up. A device prefix that ends inside a block is not extended
    (loading that whole block would overwrite a page the engine may share), so the answer is 0.
    """
    keys = tuple(chain_keys(tokens, tokens_per_block, cache_salt))
    limit = max_servable_blocks(len(tokens), tokens_per_block)
    first = num_computed_tokens // tokens_per_block
    if num_computed_tokens % tokens_per_block or first >= limit:
        return Lookup(keys, first, first, num_computed_tokens, tokens_per_block)
    end = limit
    for g in range(num_groups):  # each group is asked only about the run the others still hold
        end = contiguous_hits([stored(g, keys[first:end])], first)
        if end == first:
            break
    return Lookup(keys, first, end, num_computed_tokens, tokens_per_block)


# --- per-request state ---------------------------------------------------------------------------

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


# --- one step ------------------------------------------------------------------------------------

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
    num_scheduled_tokens``. On a first report that leaves out the promised prefix, which only
    delays (never advances) saves of the blocks past it: a runtime may honour less than promised,
    and a block is saved only once its tokens are certainly computed. A later report whose
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


# --- loads ahead of the first step (engines that load asynchronously) -----------------------------

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


# --- engines that name their blocks themselves (MAX's canonical hashes) ----------------------------

HolderFn = Callable[[Sequence[bytes]], list[bool]]
"""``holds(keys)``: for each key, whether one holder (a layer group's chunks on one TP shard) has it."""


def store_shards(tp_size: int, replicated: bool) -> range:
    """The TP shards whose namespaces hold a leaf's chunks: each of the ``tp_size`` shards its
    own, or shard 0 alone for a ``replicated`` leaf (every shard holds the same bytes, e.g. MLA's
    latent cache): stored once, read once."""
    return range(1) if replicated else range(tp_size)


def shard_routes(tp_size: int, replicated: bool) -> list[tuple[int, range]]:
    """``(source shard, destination shards)`` of a load of one leaf block: each shard's page from
    its own shard's chunk, or a replicated leaf's one chunk (shard 0's) into every shard."""
    return [(0, range(tp_size))] if replicated else [(r, range(r, r + 1)) for r in range(tp_size)]


def held_everywhere(keys: Sequence[bytes], holders: Sequence[HolderFn]) -> list[bool]:
    """Which of ``keys`` a lookup may report present, and so promise to the load that follows:
    those every holder (each shard that stores the leaf, ``store_shards``) holds; none without a
    holder. Positional, not a prefix: an engine that applies its own prefix rules to the answer
    (MAX) gets exactly the blocks it could load. A holder that leases what it holds (a lookup that
    promises) makes the answer "held and leased everywhere". Each holder is asked only about the
    keys the holders before it hold (on a shared file system each ask is a round trip)."""
    present = [bool(holders)] * len(keys)
    for holds in holders:
        todo = [i for i, p in enumerate(present) if p]
        if not todo:
            break
        for i, there in zip(todo, holds([keys[i] for i in todo])):
            present[i] = bool(there)
    return present


def plan_offload(keys: Sequence[bytes], stored: Sequence[bool], first_parent: Optional[bytes],
                 chained: bool = True) -> list[tuple[int, Optional[bytes]]]:
    """What an offload of one leaf's run of blocks writes: ``(position, parent key)`` of each
    block of ``keys`` (prefix order) that is not ``stored`` yet (on every shard that stores it).

    A block's parent is the block before it in the run, and the run's first block's is
    ``first_parent`` (what the engine showed earlier, or None): so prefix-aware eviction sees one
    chain however the engine splits a request into runs. A block already stored is skipped but
    still parents the block after it. A leaf whose blocks are not a chain (``chained=False``: a
    recurrent state's checkpoints) records no parents.
    """
    if len(keys) != len(stored):
        raise ValueError(f"{len(keys)} keys but {len(stored)} stored flags")
    return [(i, (keys[i - 1] if i else first_parent) if chained else None)
            for i, there in enumerate(stored) if not there]


# --- window-aware serving (opt-in: ``window_aware = true``) ------------------------------------------
#
# The default lookup stops at the first block ANY layer group misses, so a sliding group (which
# keeps only its window) bounds the served prefix by the smallest window. A sliding group with
# window W needs, to resume computing at token L, only the pages holding tokens [L - W, L): a query
# at position p >= L attends to [p - W + 1, p]. With the option on, the served prefix is the
# largest block boundary L such that every full-attention group holds every block below L and
# every sliding group holds the blocks intersecting [L - W, L); loads fill only those pages, and a
# sliding group saves only blocks some later lookup of this request's tokens could need.

def window_blocks(end_block: int, window: Optional[int], tokens_per_block: int, first: int = 0) -> range:
    """Block ordinals (from ``first``) a layer group needs in its pages so that computation can
    resume exactly at token ``L = end_block * tokens_per_block``: every ordinal below
    ``end_block`` under full attention (``window`` None), else those intersecting ``[L - W, L)``
    (the first holds token ``max(0, L - W)``, W need not be a multiple of the block size)."""
    if window is None:
        return range(first, max(first, end_block))
    lo = max(0, end_block * tokens_per_block - window) // tokens_per_block
    return range(max(first, lo), max(first, end_block))


def plan_lookup_window_aware(
    tokens: Sequence[int],
    cache_salt: Salt,
    tokens_per_block: int,
    num_computed_tokens: int,
    windows: Sequence[Optional[int]],
    stored: StoredFn,
) -> Lookup:
    """``plan_lookup`` with window-aware serving: blocks ``[first, end)`` where ``end`` is the
    largest ordinal (at most ``max_servable_blocks``) such that every group ``g`` (index into
    ``windows``, as ``stored`` is asked) holds ``window_blocks(end, windows[g], ...)``. Full
    attention groups bound ``end`` by their contiguous run; a sliding group may miss blocks before
    its window. Without a sliding group this is ``plan_lookup``."""
    keys = tuple(chain_keys(tokens, tokens_per_block, cache_salt))
    limit = max_servable_blocks(len(tokens), tokens_per_block)
    first = num_computed_tokens // tokens_per_block
    none = Lookup(keys, first, first, num_computed_tokens, tokens_per_block)
    if num_computed_tokens % tokens_per_block or first >= limit:
        return none
    end = limit
    for g, w in enumerate(windows):  # full attention: the contiguous run bounds the prefix
        if w is None:
            end = contiguous_hits([stored(g, keys[first:end])], first)
            if end == first:
                return none
    sliding = [g for g, w in enumerate(windows) if w is not None]
    if not sliding:
        return Lookup(keys, first, end, num_computed_tokens, tokens_per_block)
    # ask each sliding group only about blocks some candidate end could need
    base = {g: window_blocks(first + 1, windows[g], tokens_per_block, first).start for g in sliding}
    present = {g: stored(g, keys[base[g]:end]) for g in sliding}
    for b in range(end, first, -1):
        if all(all(present[g][o - base[g]] for o in window_blocks(b, windows[g], tokens_per_block, first)) for g in sliding):
            return Lookup(keys, first, b, num_computed_tokens, tokens_per_block)
    return none


def lookup_needs(lookup: Lookup, windows: Sequence[Optional[int]]) -> list[range]:
    """Per group index: the block ordinals a window-aware lookup's promise loads (and leases)."""
    tpb = lookup.tokens_per_block
    if lookup.end_block <= lookup.first_block:
        return [range(0) for _ in windows]
    return [window_blocks(lookup.end_block, w, tpb, lookup.first_block) for w in windows]


def window_keep_from(num_tokens: int, window: Optional[int], tokens_per_block: int) -> int:
    """First block ordinal a sliding group saves under window-aware serving, for a request of
    ``num_tokens`` tokens: the first block a lookup of these tokens (served up to
    ``max_servable_blocks``) or of any longer prompt sharing them could need. A block before it
    ends at least W tokens before the request's last full block. 0 for full attention."""
    if window is None:
        return 0
    return window_blocks(max_servable_blocks(num_tokens, tokens_per_block), window, tokens_per_block).start
