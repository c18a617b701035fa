"""The planner's rules, as pure functions over plain data (no store, no engine).

A small simulated engine (``_Sim``) reports chunked prefill and generation the way TensorRT-LLM
does (first report restates everything, later reports are deltas, sliding windows report ``-1``
in place for passed blocks and never restate an earlier entry), and hypothesis drives it.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdskv.keys import chain_keys
from gdskv.layout import BAD_PAGE_INDEX
from gdskv.planner import (
    ConnectorMetadata,
    PageOp,
    RequestPlan,
    StepReport,
    contiguous_hits,
    first_live_block,
    held_everywhere,
    max_servable_blocks,
    new_request,
    plan_lookup,
    plan_offload,
    plan_step,
    shard_routes,
    store_shards,
    take_promised_loads,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stored_in(held: dict[int, set[bytes]]):
    """A ``stored`` predicate over per-group key sets."""
    return lambda g, keys: [k in held.get(g, set()) for k in keys]


# --- helpers -------------------------------------------------------------------------------------

def test_max_servable_blocks_leaves_a_token_to_compute():
    assert max_servable_blocks(0, 4) == 0
    assert max_servable_blocks(1, 4) == 0
    assert max_servable_blocks(4, 4) == 0
    assert max_servable_blocks(5, 4) == 1
    assert max_servable_blocks(8, 4) == 1
    assert max_servable_blocks(9, 4) == 2


@given(end=st.integers(0, 200), window=st.integers(1, 64), tpb=st.integers(1, 16))
def test_first_live_block_is_the_first_block_wholly_in_the_window(end, window, tpb):
    lo = end - window + 1  # the oldest position a query at ``end`` attends to
    first = first_live_block(end, window, tpb)
    assert first * tpb >= lo
    if first > 0:
        assert (first - 1) * tpb < lo
    assert first_live_block(end, None, tpb) == 0


@given(st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=4), st.integers(0, 5))
def test_contiguous_hits_stops_at_the_first_ordinal_any_holder_misses(present, first):
    end = contiguous_hits(present, first)
    run = end - first
    assert all(p[i] for p in present for i in range(run))
    assert run == 6 or not all(p[run] for p in present)


# --- lookup ----------------------------------------------------------------------------------------

tokens_st = st.lists(st.integers(0, 50), min_size=1, max_size=60)


@SETTINGS
@given(tokens=tokens_st, tpb=st.integers(1, 8), groups=st.integers(1, 3), data=st.data())
def test_served_prefix_never_exceeds_any_groups_contiguous_hits(tokens, tpb, groups, data):
    keys = chain_keys(tokens, tpb)
    held = {g: {k for k in keys if data.draw(st.booleans())} for g in range(groups)}
    lookup = plan_lookup(tokens, None, tpb, 0, groups, stored_in(held))
    for g in range(groups):
        run = 0
        while run < len(keys) and keys[run] in held[g]:
            run += 1
        assert lookup.end_block <= run
    assert lookup.end_block <= max_servable_blocks(len(tokens), tpb)
    assert lookup.num_new_tokens == lookup.end_block * tpb
    assert lookup.num_new_tokens <= len(tokens) - 1
    # maximal: the next block is missing somewhere or the cap is reached
    if lookup.end_block < max_servable_blocks(len(tokens), tpb):
        assert any(keys[lookup.end_block] not in held[g] for g in range(groups))


def test_lookup_never_serves_the_whole_prompt():
    tokens = list(range(16))
    keys = chain_keys(tokens, 4)
    lookup = plan_lookup(tokens, None, 4, 0, 1, stored_in({0: set(keys)}))
    assert lookup.end_block == 3 and lookup.num_new_tokens == 12


def test_lookup_starts_after_the_device_prefix_and_refuses_a_partial_one():
    tokens = list(range(20))
    keys = chain_keys(tokens, 4)
    held = {0: set(keys[2:])}  # blocks 0-1 evicted from the store, held on the device
    assert plan_lookup(tokens, None, 4, 0, 1, stored_in(held)).num_new_tokens == 0
    lookup = plan_lookup(tokens, None, 4, 8, 1, stored_in(held))
    assert (lookup.first_block, lookup.end_block, lookup.num_new_tokens) == (2, 4, 8)
    assert plan_lookup(tokens, None, 4, 9, 1, stored_in(held)).num_new_tokens == 0


@given(tokens=st.lists(st.integers(0, 50), min_size=9, max_size=40), salt=st.text(min_size=1, max_size=5))
def test_keys_include_the_salt_and_a_salt_never_hits_another_salts_blocks(tokens, salt):
    plain, salted = chain_keys(tokens, 4), chain_keys(tokens, 4, salt)
    assert not set(plain) & set(salted)
    held = {0: set(salted)}
    assert plan_lookup(tokens, None, 4, 0, 1, stored_in(held)).num_new_tokens == 0
    assert plan_lookup(tokens, salt + "x", 4, 0, 1, stored_in(held)).num_new_tokens == 0
    assert plan_lookup(tokens, salt, 4, 0, 1, stored_in(held)).num_new_tokens == max_servable_blocks(len(tokens), 4) * 4


# --- page slots ----------------------------------------------------------------------------------

def test_pages_come_only_from_valid_entries_and_minus_one_removes_a_page():
    state = new_request(1, list(range(12)), None, 4, 2)
    state.record_alloc([[5, 6, 7], [BAD_PAGE_INDEX, 3, 4]])
    assert state.pages == [{0: 5, 1: 6, 2: 7}, {1: 3, 2: 4}]
    state.apply_pages(0, 0, [BAD_PAGE_INDEX, 6])
    assert state.pages[0] == {1: 6, 2: 7}


def test_state_takes_the_lookups_keys_and_refuses_a_lookup_of_other_tokens():
    tokens = list(range(10))
    lookup = plan_lookup(tokens, "s", 4, 0, 1, stored_in({}))
    assert new_request(1, tokens, "s", 4, 1, lookup).keys == chain_keys(tokens, 4, "s")
    with pytest.raises(ValueError, match="the lookup keyed 2 blocks"):
        new_request(1, tokens + list(range(4)), "s", 4, 1, lookup)


def test_more_page_lists_than_groups_is_refused():
    state = new_request(1, list(range(8)), None, 4, 1)
    with pytest.raises(ValueError, match="2 layer groups"):
        state.record_alloc([[0, 1], [2, 3]])


# --- a simulated engine --------------------------------------------------------------------------

@dataclass
class _Sim:
    """Reports one request's steps like TensorRT-LLM; allocates distinct slots per group."""

    prompt: list[int]
    tpb: int
    chunk: int
    windows: list[Optional[int]]
    gen: int = 3
    loaded: int = 0  # tokens served from the store (block aligned)
    tokens: list[int] = field(default_factory=list)
    pages: list[list[int]] = field(default_factory=list)
    reported_pages: list[int] = field(default_factory=list)
    reported_tokens: int = 0
    computed: int = 0
    next_slot: int = 100

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.pages = [[] for _ in self.windows]
        self.reported_pages = [0] * len(self.windows)
        self.computed = self.loaded

    def _alloc_through(self, end: int) -> None:
        for ids in self.pages:
            while len(ids) * self.tpb < end:
                ids.append(self.next_slot)
                self.next_slot += 1

    def _reclaim(self) -> None:
        for w, ids in zip(self.windows, self.pages):
            if w is None:
                continue
            for b in range(len(ids)):
                if (b + 1) * self.tpb <= self.computed - w + 1:
                    ids[b] = BAD_PAGE_INDEX

    def steps(self):
        """Yield ``(report, first, end)`` per step; ``end`` = tokens with KV after the step."""
        first = True
        while True:
            self._reclaim()
            if self.computed < len(self.prompt):
                n = min(self.chunk, len(self.prompt) - self.computed)
            elif len(self.tokens) - len(self.prompt) < self.gen:
                n = 1
            else:
                return
            self._alloc_through(self.computed + n)
            report = StepReport(
                request_id=7,
                new_tokens=self.tokens[self.reported_tokens:],
                new_block_ids_by_group=[ids[r:] for ids, r in zip(self.pages, self.reported_pages)],
                computed_position=self.computed,
                num_scheduled_tokens=n,
            )
            self.reported_tokens = len(self.tokens)
            self.reported_pages = [len(ids) for ids in self.pages]
            yield report, first, self.computed + n
            first = False
            self.computed += n
            if self.computed >= len(self.prompt):
                self.tokens.append(len(self.tokens) % 50)


def _run(sim: _Sim, held: dict[int, set[bytes]], lookup=None) -> list[tuple[int, RequestPlan, list[list[int]]]]:
    """Plan every step; saved keys become 'stored' at once. Returns (end, plan, page lists) per step."""
    state = new_request(7, sim.prompt, None, sim.tpb, len(sim.windows), lookup)
    out = []
    for report, first, end in sim.steps():
        plan = plan_step(state, report, first, sim.windows, stored_in(held))
        for g, ops in plan.saves.items():
            held.setdefault(g, set()).update(op.key for op in ops)
        out.append((end, plan, [list(ids) for ids in sim.pages]))
    return out


sim_st = st.builds(
    lambda n, tpb, chunk, gen: (n, tpb, chunk, gen),
    st.integers(1, 50), st.integers(1, 6), st.integers(1, 20), st.integers(1, 6),
)


@SETTINGS
@given(shape=sim_st, groups=st.integers(1, 3))
def test_chunked_prefill_deltas_plan_every_full_block_exactly_once(shape, groups):
    n, tpb, chunk, gen = shape
    sim = _Sim(list(range(n)), tpb, chunk, [None] * groups, gen)
    steps = _run(sim, {})
    keys = chain_keys(sim.tokens, tpb)
    final_end = steps[-1][0]
    for g in range(groups):
        saved = [(op, end) for end, plan, _ in steps for op in plan.saves.get(g, ())]
        ordinals = [keys.index(op.key) for op, _ in saved]
        assert sorted(ordinals) == list(range(final_end // tpb)), "every full block, once"
        for (op, end), o in zip(saved, ordinals):
            assert op.layer_group_id == g
            assert op.page_slot == sim.pages[g][o] and op.page_slot >= 0
            assert op.parent_key == (keys[o - 1] if o else None)
            assert (o + 1) * tpb <= end, "saved in a step that completed it, not before"
        # and as soon as it completed: in the first step whose end covers it
        for (op, end), o in zip(saved, ordinals):
            earlier = [e for e, _, _ in steps if e < end]
            assert not earlier or (o + 1) * tpb > max(earlier)


@SETTINGS
@given(shape=sim_st, window=st.integers(1, 24), full_too=st.booleans())
def test_sliding_window_saves_only_live_blocks_with_live_pages(shape, window, full_too):
    n, tpb, chunk, gen = shape
    windows = [window, None] if full_too else [window]
    sim = _Sim(list(range(n)), tpb, chunk, windows, gen)
    for end, plan, pages in _run(sim, {}):
        for op in plan.saves.get(0, ()):
            o = chain_keys(sim.tokens, tpb).index(op.key)
            assert o * tpb >= end - window + 1, "whole block inside the window at the end of the step"
            assert pages[0][o] == op.page_slot != BAD_PAGE_INDEX, "a page the cache still holds"


def test_single_pass_prefill_under_a_window_persists_at_most_the_window():
    sim = _Sim(list(range(39)), 4, 64, [12], gen=1)
    held: dict[int, set[bytes]] = {}
    _run(sim, held)
    keys = chain_keys(sim.prompt, 4)
    assert sorted(keys.index(k) for k in held[0]) == [7, 8], "the blocks wholly inside the last 12 tokens"
    # a later identical prompt: block 0 is missing in the sliding group, so nothing is served
    assert plan_lookup(sim.prompt, None, 4, 0, 1, stored_in(held)).num_new_tokens == 0


def test_vswa_lookup_is_bounded_by_the_smallest_window():
    prompt = list(range(11))
    held: dict[int, set[bytes]] = {}
    _run(_Sim(prompt, 4, 64, [12, 20, None], gen=1), held)  # short prompt: fits every window
    longer = prompt + list(range(50, 78))
    keys = chain_keys(longer, 4)
    _run(_Sim(longer, 4, 64, [12, 20, None], gen=1), held)
    assert all(keys[o] in held[2] for o in range(9)), "the full group holds the whole prompt"
    lookup = plan_lookup(longer, None, 4, 0, 3, stored_in(held))
    assert lookup.num_new_tokens == 8 <= 12


# --- loads -----------------------------------------------------------------------------------------

def test_loads_go_to_the_promised_blocks_pages_in_every_group_and_are_not_saved_back():
    prompt = list(range(23))
    keys = chain_keys(prompt, 4)
    held = {0: set(keys[:4]), 1: set(keys[:4])}
    lookup = plan_lookup(prompt, None, 4, 0, 2, stored_in(held))
    assert lookup.num_new_tokens == 16
    # pages for the promised prefix and a first chunk of 8; the sliding group (window 9) has no
    # page for blocks 0-1, which are out of its window
    pages = [[10, 11, 12, 13, 14, 15], [BAD_PAGE_INDEX, BAD_PAGE_INDEX, 22, 23, 24, 25]]
    state = new_request(7, prompt, None, 4, 2, lookup)
    state.record_alloc(pages)
    # TensorRT-LLM leaves the promised tokens out of a first report's computed_position
    plan = plan_step(state, StepReport(7, prompt, pages, 0, 7), True, [None, 9], stored_in(held))
    assert [(op.page_slot, op.key) for op in plan.loads[0]] == [(pages[0][o], keys[o]) for o in range(4)]
    assert [(op.page_slot, op.key) for op in plan.loads[1]] == [(pages[1][o], keys[o]) for o in range(2, 4)]
    assert all(op.page_slot >= 0 for ops in plan.loads.values() for op in ops)
    assert not plan.saves, "promised blocks are not written back; later ones wait for a certain position"
    # the next report (authoritative position 23) saves the computed blocks 4 and 5
    plan2 = plan_step(state, StepReport(7, [5], [[], []], 23, 1), False, [None, 9], stored_in(held))
    keys = chain_keys(prompt + [5], 4)
    assert [op.key for op in plan2.saves[0]] == keys[4:6]
    assert [op.key for op in plan2.saves[1]] == keys[4:6]


def test_rewind_after_a_discarded_load_replans_the_recomputed_blocks():
    prompt = list(range(23))
    keys = chain_keys(prompt, 4)
    held = {0: set(keys[:2])}
    lookup = plan_lookup(prompt, None, 4, 0, 1, stored_in(held))
    state = new_request(7, prompt, None, 4, 1, lookup)
    pages = list(range(10, 16))
    plan = plan_step(state, StepReport(7, prompt, [pages], 8, 8), True, [None], stored_in({}))
    assert len(plan.loads[0]) == 2 and [op.key for op in plan.saves[0]] == keys[2:4]
    # the load failed; the engine recomputes from 0 on the same pages (no new tokens or pages)
    plan = plan_step(state, StepReport(7, [], [[]], 0, 8), False, [None], stored_in({}))
    assert not plan.loads and [op.key for op in plan.saves[0]] == keys[0:2]


def test_blocks_loaded_ahead_are_not_asked_about_again_unless_the_engine_recomputes_them():
    """An asynchronous load (``take_promised_loads``) of blocks the lookup found: the first report
    that says they are computed plans no presence check of them (32k tokens: 512 of them on the
    serving thread); a report computed only up to a failed block (vLLM recomputes from there)
    asks about the blocks from that one on and saves the one whose chunk went; a rewind after a
    failure reported later asks about them all again."""
    prompt = list(range(23))
    keys = chain_keys(prompt + [23], 4)  # 5 full blocks in the prompt, a 6th once a token is generated
    held = {0: set(keys[:5])}
    asked: list[bytes] = []

    def stored(g, ks):
        asked.extend(ks)
        return stored_in(held)(g, ks)

    def loaded_ahead():
        asked.clear()
        held[0] = set(keys[:5])
        state = new_request(7, prompt, None, 4, 1, plan_lookup(prompt, None, 4, 0, 1, stored_in(held)))
        loads = take_promised_loads(state, [list(range(10, 16))], 5 * 4)
        assert [op.key for op in loads[0]] == keys[:5] and state.loaded == (0, 5)
        return state

    state = loaded_ahead()
    plan = plan_step(state, StepReport(7, prompt, [list(range(10, 16))], 20, 2), True, [None], stored)
    assert asked == [] and not plan.loads and not plan.saves  # block 5 is not complete yet
    plan = plan_step(state, StepReport(7, [23], [[]], 22, 2), False, [None], stored)
    assert asked == [keys[5]] and [op.key for op in plan.saves[0]] == [keys[5]]

    state = loaded_ahead()  # block 3's chunk was corrupt (quarantined): the engine computes from 12
    held[0].discard(keys[3])
    plan = plan_step(state, StepReport(7, prompt, [list(range(10, 16))], 12, 11), True, [None], stored)
    assert asked == [keys[3], keys[4]] and [op.key for op in plan.saves[0]] == [keys[3]]

    state = loaded_ahead()
    plan_step(state, StepReport(7, prompt, [list(range(10, 16))], 20, 0), True, [None], stored)
    held[0].discard(keys[3])
    plan = plan_step(state, StepReport(7, [], [[]], 0, 20), False, [None], stored)  # the failure, reported later
    assert asked == keys[:5] and [op.key for op in plan.saves[0]] == [keys[3]]


def test_a_salt_first_seen_in_the_report_salts_every_save():
    prompt = list(range(12))
    state = new_request(3, prompt, None, 4, 1)  # the lookup's request object had no cache_salt
    plan = plan_step(state, StepReport(3, prompt, [[0, 1, 2]], 0, 12, "tenant"), True, [None], stored_in({}))
    assert [op.key for op in plan.saves[0]] == chain_keys(prompt, 4, "tenant")


def test_metadata_is_picklable_and_lists_ops_per_group():
    state = new_request(3, list(range(8)), "salt", 4, 2)
    plan = plan_step(state, StepReport(3, list(range(8)), [[4, 5], [6, BAD_PAGE_INDEX]], 0, 8, "salt"), True, [None, None], stored_in({}))
    meta = ConnectorMetadata((plan,), step=1)
    back = pickle.loads(pickle.dumps(meta))
    assert back == meta
    assert [(rid, op.page_slot) for rid, op in back.saves_of_group(0)] == [(3, 4), (3, 5)]
    assert [(rid, op.page_slot) for rid, op in back.saves_of_group(1)] == [(3, 6)]
    assert back.saves_of_group(0)[0][1].key == chain_keys(list(range(8)), 4, "salt")[0]



def _ops(keys: list[bytes], parents: list, first_slot: int = 1000, gid: int = 0) -> tuple[PageOp, ...]:
    return tuple(PageOp(gid, first_slot + 7 * i, k, p) for i, (k, p) in enumerate(zip(keys, parents)))


def test_plans_pickle_as_columns_and_come_back_op_for_op():
    """A step's ops travel as columns (``RequestPlan.__reduce__``): every op comes back equal,
    as a ``PageOp``, for a lookup's chained run from block 0, a run chained on a parent, saves
    whose parents do not chain (None among them), one op, keys of mixed lengths or ops of mixed
    layer groups (sent as they are) and empty groups; inside the TensorRT-LLM scheduler's ``StepMetadata`` too."""
    from gdskv.connectors.trtllm.scheduler import StepMetadata

    keys = chain_keys(list(range(64 * 40)), 64)
    plans = (
        RequestPlan(1, loads={0: _ops(keys, [None, *keys[:-1]]), 2: _ops(keys[5:], keys[4:-1], gid=2)}),
        RequestPlan(2, saves={0: _ops(keys[::3], [keys[1], None, *keys[:11]]), 1: _ops(keys[:1], [None], gid=1)}),
        RequestPlan(3, loads={0: _ops([keys[0], keys[1][:8]], [None, keys[0]])}, saves={0: ()}),
        RequestPlan(5, saves={0: (PageOp(0, 3, keys[1], keys[0]), PageOp(1, 4, keys[2], keys[1]))}),
        RequestPlan(4),
    )
    for meta in (ConnectorMetadata(plans, step=9), StepMetadata(plans, step=9, async_loads=frozenset({1}))):
        back = pickle.loads(pickle.dumps(meta))
        assert back == meta and type(back) is type(meta)
        for sent, got in zip(meta.plans, back.plans):
            for kind in ("loads", "saves"):
                for gid, ops in getattr(sent, kind).items():
                    came = getattr(got, kind)[gid]
                    assert [tuple(op) for op in came] == [tuple(op) for op in ops]
                    assert all(type(op) is PageOp for op in came)
        assert [op.parent_key for _, op in back.loads_of_group(0)][:3] == [None, keys[0], keys[1]]


# --- engines that name their blocks themselves (MAX) ---------------------------------------------

def test_a_replicated_leaf_is_stored_on_shard_0_and_loaded_into_every_shard():
    assert list(store_shards(4, False)) == [0, 1, 2, 3]
    assert list(store_shards(4, True)) == [0]
    assert [(src, list(dst)) for src, dst in shard_routes(3, False)] == [(0, [0]), (1, [1]), (2, [2])]
    assert [(src, list(dst)) for src, dst in shard_routes(3, True)] == [(0, [0, 1, 2])]
    assert [(src, list(dst)) for src, dst in shard_routes(1, False)] == [(0, [0])]


class _Holder:
    """One shard's chunks; records what it was asked."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys, self.asked = keys, []

    def __call__(self, keys):
        self.asked.append(list(keys))
        return [k in self.keys for k in keys]


def test_a_lookup_promises_only_what_every_shard_holds_positionally():
    keys = [bytes([i]) * 8 for i in range(5)]
    shard0, shard1 = _Holder({keys[0], keys[1], keys[3], keys[4]}), _Holder({keys[0], keys[3], keys[2]})
    assert held_everywhere(keys, [shard0, shard1]) == [True, False, False, True, False]
    assert shard1.asked == [[keys[0], keys[1], keys[3], keys[4]]]  # only what shard 0 holds
    assert held_everywhere(keys, []) == [False] * 5  # no holder: nothing is promised
    assert held_everywhere([], [shard0]) == []
    nothing = _Holder(set())
    after = _Holder(set(keys))
    assert held_everywhere(keys, [nothing, after]) == [False] * 5 and after.asked == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=4))
def test_held_everywhere_is_the_and_over_holders(masks):
    keys = [bytes([i]) * 8 for i in range(6)]
    holders = [_Holder({k for k, m in zip(keys, mask) if m}) for mask in masks]
    assert held_everywhere(keys, holders) == [all(m[i] for m in masks) for i in range(6)]


def test_an_offload_skips_stored_blocks_and_chains_each_to_the_block_before_it():
    a, b, c, d = (bytes([i]) * 8 for i in range(4))
    assert plan_offload([a, b, c, d], [False] * 4, None) == [(0, None), (1, a), (2, b), (3, c)]
    # a stored block is skipped but still parents the next; the run's first block takes the
    # parent the engine showed earlier (lineage)
    z = b"z" * 8
    assert plan_offload([a, b, c, d], [True, False, True, False], z) == [(1, a), (3, c)]
    assert plan_offload([a, b], [False, False], z) == [(0, z), (1, a)]
    assert plan_offload([a, b], [True, True], z) == []
    # a recurrent leaf's checkpoints are not a chain: no parents
    assert plan_offload([a, b], [False, False], z, chained=False) == [(0, None), (1, None)]
    with pytest.raises(ValueError, match="2 keys but 1 stored"):
        plan_offload([a, b], [False], None)


# --- window-aware serving (opt-in) ------------------------------------------------------------------

from gdskv.planner import lookup_needs, plan_lookup_window_aware, window_blocks, window_keep_from  # noqa: E402


@given(end_block=st.integers(0, 40), window=st.one_of(st.none(), st.integers(1, 64)), tpb=st.integers(1, 16),
       first=st.integers(0, 40))
def test_window_blocks_are_the_blocks_intersecting_the_window_before_the_served_length(end_block, window, tpb, first):
    L = end_block * tpb
    lo = 0 if window is None else max(0, L - window)
    expected = [o for o in range(first, end_block) if (o + 1) * tpb > lo]  # block o holds [o*tpb, (o+1)*tpb)
    assert list(window_blocks(end_block, window, tpb, first)) == expected


def test_window_blocks_edge_cases():
    assert window_blocks(9, 8, 4) == range(7, 9), "L=36, W=8: tokens 28..35, a block boundary"
    assert window_blocks(9, 14, 4) == range(5, 9), "W not a multiple of the block: block 5 holds token 22"
    assert window_blocks(9, 9, 4) == range(6, 9), "one token past a boundary pulls in the block before"
    assert window_blocks(2, 8, 4) == range(0, 2), "L == W: every block"
    assert window_blocks(1, 8, 4) == range(0, 1), "L < W: every block"
    assert window_blocks(9, 8, 4, first=8) == range(8, 9), "blocks below first are on the device"
    assert window_blocks(9, None, 4, first=2) == range(2, 9)
    assert window_blocks(0, 8, 4) == range(0)


def _held_blocks(prompt: list[int], tpb: int, blocks_by_group: dict[int, list[int]]) -> dict[int, set[bytes]]:
    keys = chain_keys(prompt, tpb)
    return {g: {keys[o] for o in blocks} for g, blocks in blocks_by_group.items()}


P39 = list(range(39))  # 9 full blocks + 3 tokens: at most 9 blocks (36 tokens) served


@pytest.mark.parametrize("sliding_holds,served", [
    ([7, 8], 36),                           # only the window tail before 36: served past the window
    ([0, 1, 2, 3, 5, 7, 8], 36),            # a middle block missing outside the window does not matter
    ([0, 1, 2, 3, 5, 6, 7], 32),            # block 8 missing: 32 needs 6, 7
    ([0, 1, 2, 3, 5, 7], 16),               # 36 needs 8, 32 needs 6, ..., 16 needs 2, 3
    ([8], 0),                               # every candidate misses a block of its window
])
def test_window_aware_lookup_serves_the_largest_length_every_group_can(sliding_holds, served):
    held = _held_blocks(P39, 4, {0: sliding_holds, 1: list(range(9))})
    found = plan_lookup_window_aware(P39, None, 4, 0, [8, None], stored_in(held))
    assert found.num_new_tokens == served and found.first_block == 0
    # the default is unchanged: the smallest-window rule stops at the first block group 0 misses
    default = plan_lookup(P39, None, 4, 0, 2, stored_in(held))
    assert default.end_block == contiguous_hits([[o in sliding_holds for o in range(9)]])
    if served:
        assert lookup_needs(found, [8, None]) == [window_blocks(found.end_block, 8, 4), range(0, found.end_block)]


def test_window_aware_lookup_full_group_missing_a_middle_block_bounds_the_prefix():
    held = _held_blocks(P39, 4, {0: list(range(9)), 1: [0, 1, 2, 3, 5, 6, 7, 8], 2: list(range(9))})
    found = plan_lookup_window_aware(P39, None, 4, 0, [14, None, 6], stored_in(held))
    assert found.end_block == 4
    # window 14 at L=16 needs blocks 0..3 (token 2 on), window 6 only blocks 2..3 (token 10 on)
    held = _held_blocks(P39, 4, {0: [0, 1, 2, 3], 1: list(range(9)), 2: [1, 2, 3]})
    assert plan_lookup_window_aware(P39, None, 4, 0, [14, None, 6], stored_in(held)).end_block == 4
    assert plan_lookup(P39, None, 4, 0, 3, stored_in(held)).end_block == 0


def test_window_aware_lookup_after_a_device_prefix_and_never_the_whole_prompt():
    held = _held_blocks(P39, 4, {0: [8], 1: list(range(2, 9))})
    found = plan_lookup_window_aware(P39, None, 4, 8, [4, None], stored_in(held))
    assert (found.first_block, found.end_block, found.num_new_tokens) == (2, 9, 28)
    assert plan_lookup_window_aware(P39, None, 4, 6, [4, None], stored_in(held)).num_new_tokens == 0
    p36 = P39[:36]
    everything = _held_blocks(p36, 4, {0: list(range(9)), 1: list(range(9))})
    assert plan_lookup_window_aware(p36, None, 4, 0, [4, None], stored_in(everything)).end_block == 8


@SETTINGS
@given(n=st.integers(1, 40), tpb=st.integers(1, 5), windows=st.lists(st.one_of(st.none(), st.integers(1, 20)), min_size=1, max_size=3),
       data=st.data())
def test_window_aware_lookup_is_the_largest_valid_length_and_at_least_the_default(n, tpb, windows, data):
    prompt = list(range(n))
    blocks = n // tpb
    masks = [data.draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks)) for _ in windows]
    held = _held_blocks(prompt, tpb, {g: [o for o, m in enumerate(mask) if m] for g, mask in enumerate(masks)})
    found = plan_lookup_window_aware(prompt, None, tpb, 0, windows, stored_in(held))
    valid = [b for b in range(1, max_servable_blocks(n, tpb) + 1)
             if all(all(masks[g][o] for o in window_blocks(b, w, tpb)) for g, w in enumerate(windows))]
    assert found.end_block == max(valid, default=0)
    assert found.end_block >= plan_lookup(prompt, None, tpb, 0, len(windows), stored_in(held)).end_block
    if all(w is None for w in windows):
        assert found == plan_lookup(prompt, None, tpb, 0, len(windows), stored_in(held))


def _run_window_aware(sim: _Sim, held: dict[int, set[bytes]], lookup=None):
    state = new_request(7, sim.prompt, None, sim.tpb, len(sim.windows), lookup)
    out = []
    for report, first, end in sim.steps():
        plan = plan_step(state, report, first, sim.windows, stored_in(held), window_aware=True)
        for g, ops in plan.saves.items():
            held.setdefault(g, set()).update(op.key for op in ops)
        out.append((end, plan, [list(ids) for ids in sim.pages], len(sim.tokens)))
    return out


@SETTINGS
@given(shape=sim_st, window=st.integers(1, 24))
def test_window_aware_saves_only_the_window_tail_of_a_sliding_group(shape, window):
    n, tpb, chunk, gen = shape
    sim = _Sim(list(range(n)), tpb, chunk, [window, None], gen)
    held: dict[int, set[bytes]] = {}
    steps = _run_window_aware(sim, held)
    keys = chain_keys(sim.tokens, tpb)
    for end, plan, pages, num_tokens in steps:
        for op in plan.saves.get(0, ()):
            o = keys.index(op.key)
            assert o >= window_keep_from(num_tokens, window, tpb)
            assert (o + 1) * tpb > max_servable_blocks(num_tokens, tpb) * tpb - window, "inside the window before the last servable boundary"
            assert pages[0][o] == op.page_slot != BAD_PAGE_INDEX and (o + 1) * tpb <= end
    # the full group is unaffected: every completed block
    assert sorted(keys.index(k) for k in held.get(1, ())) == list(range(steps[-1][0] // tpb))
    if gen == 1 and chunk >= n:  # a single pass: the sliding group's bytes are bounded by the window
        assert len(held.get(0, ())) <= -(-window // tpb) + 2


def test_window_aware_single_pass_saves_what_a_later_lookup_needs_and_serves_it_back():
    sim = _Sim(P39, 4, 64, [8, 14, None], gen=1)
    held: dict[int, set[bytes]] = {}
    _run_window_aware(sim, held)
    keys = chain_keys(P39, 4)
    assert sorted(keys.index(k) for k in held[0]) == [7, 8], "block 7 passes the window at 39 but 36 needs it"
    assert sorted(keys.index(k) for k in held[1]) == [5, 6, 7, 8]
    assert sorted(keys.index(k) for k in held[2]) == list(range(9))
    assert plan_lookup(P39, None, 4, 0, 3, stored_in(held)).num_new_tokens == 0, "default: smallest-window rule"
    found = plan_lookup_window_aware(P39, None, 4, 0, [8, 14, None], stored_in(held))
    assert found.num_new_tokens == 36
    # the loads fill only each sliding group's window pages; nothing promised is saved back
    pages = [list(range(10, 20)), list(range(20, 30)), list(range(30, 40))]
    state = new_request(7, P39, None, 4, 3, found)
    state.record_alloc(pages)
    plan = plan_step(state, StepReport(7, P39, pages, 0, 3), True, [8, 14, None], stored_in(held), window_aware=True)
    assert {g: [keys.index(op.key) for op in ops] for g, ops in plan.loads.items()} == {0: [7, 8], 1: [5, 6, 7, 8], 2: list(range(9))}
    assert not plan.saves
    # window_aware=False keeps the old loads: every promised block with a page
    state = new_request(7, P39, None, 4, 3, found)
    state.record_alloc(pages)
    plan = plan_step(state, StepReport(7, P39, pages, 0, 3), True, [8, 14, None], stored_in(held))
    assert all(len(ops) == 9 for ops in plan.loads.values())


def test_loads_async_takes_big_full_attention_loads_out_of_the_forward_pass():
    from gdskv.planner import Lookup, loads_async

    keys = tuple(bytes([i]) * 32 for i in range(10))
    hit = Lookup(keys, first_block=2, end_block=10, num_computed_tokens=32, tokens_per_block=16)  # 8 blocks
    assert loads_async(hit, bytes_per_block=1 << 20, min_bytes=8 << 20, window_aware=False)
    assert not loads_async(hit, bytes_per_block=1 << 20, min_bytes=(8 << 20) + 1, window_aware=False)
    assert not loads_async(hit, bytes_per_block=1 << 20, min_bytes=None, window_aware=False)  # turned off
    assert not loads_async(hit, bytes_per_block=1 << 20, min_bytes=1, window_aware=True)  # promise per window
    miss = Lookup(keys, first_block=2, end_block=2, num_computed_tokens=32, tokens_per_block=16)
    assert not loads_async(miss, bytes_per_block=1 << 20, min_bytes=0, window_aware=False)
