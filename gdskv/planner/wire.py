"""What a connector's scheduler hands its workers each step (``ConnectorMetadata``: the pages
to load and save per request) and what an engine reports of a request each step
(``StepReport``); both plain data, pickled across processes in a compact wire form."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

Salt = Optional[str | bytes | int]
StoredFn = Callable[[int, Sequence[bytes]], list[bool]]
"""``stored(layer_group_id, keys)``: for each key, whether the store holds it (every TP shard)."""


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


@dataclass(frozen=True)
class StepReport:
    """One request's entry of a step, engine-neutral (built from TensorRT-LLM's ``RequestData``).

    ``new_tokens`` and ``new_block_ids_by_group[g]`` are deltas since the request's previous
    report (everything, on its first). ``computed_position`` counts tokens whose KV exists before
    this step, the loaded prefix included (TensorRT-LLM's first report leaves out the tokens the
    connector offered: the adapter adds them back);
    ``num_scheduled_tokens`` is what this step's forward pass computes.
    """

    request_id: int
    new_tokens: Sequence[int]
    new_block_ids_by_group: Sequence[Sequence[int]]
    computed_position: int
    num_scheduled_tokens: int
    cache_salt: Salt = None
