"""An in-memory KV cache connector that records every call, for the reference engine's tests.

A test utility, not the product connector (that is ``gdskv.connectors.trtllm``): it keeps page
bytes in a dict keyed by ``(tp_rank, layer_group, chained block key)``, plans like the spec's
example connector (loads on a request's first report, a save as soon as a block's tokens
complete, both per layer group through ``valid_page_slots``), and appends one tuple per call to a
shared ``calls`` list so tests can check the engine's call sequence.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from gdskv.engine import EngineConfig, ModelConfig, SchedulerOutput
from gdskv.engine.pool import POISON_BYTE, layer_groups_of
from gdskv.keys import chain_keys
from gdskv.layout import KvCacheLayout, single_pool_layout, valid_page_slots
from gdskv.transfer import page_segments

Call = tuple  # (who, method, *details): who is "scheduler" or "worker<rank>"


@dataclass
class MemoryStore:
    """Page bytes per ``(rank, group, key)``; keys in ``corrupt`` load as garbage and fail."""

    tp_size: int
    num_groups: int
    pages: dict[tuple[int, int, bytes], list[torch.Tensor]] = field(default_factory=dict)
    corrupt: set[bytes] = field(default_factory=set)

    def has_everywhere(self, key: bytes) -> bool:
        return all((rank, g, key) in self.pages for rank in range(self.tp_size) for g in range(self.num_groups))


@dataclass(frozen=True)
class Transfer:
    request_id: int
    group: int
    ordinal: int
    slot: int
    key: bytes


@dataclass
class MemoryMeta:
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class _Tracked:
    tokens: list[int]
    blocks: list[list[int]]
    salt: Optional[str]


class _SchedulerCore:
    """Lookup and planning shared by the flat and per-layer-group schedulers."""

    _flat = False

    def __init__(self, store: MemoryStore, tokens_per_block: int, calls: list[Call], async_load: bool, async_save: bool,
                 offer: Optional[Callable[[int, int], int]] = None) -> None:
        self.store, self.tpb, self.calls = store, tokens_per_block, calls
        self.async_load, self.async_save, self.offer = async_load, async_save, offer
        self.requests: dict[int, _Tracked] = {}
        self.offered: dict[int, int] = {}
        """Tokens offered for a synchronous load, which the first report leaves out (TensorRT-LLM's way)."""
        self.answers: dict[int, tuple[int, bool]] = {}
        """Every request's last ``get_num_new_matched_tokens`` answer (for the tests' checks)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append(("scheduler", "get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        hits = 0
        for key in chain_keys(request.get_tokens(0), self.tpb, request.cache_salt):
            if not self.store.has_everywhere(key):
                break
            hits += 1
        tokens = hits * self.tpb
        if self.offer is not None:
            tokens = self.offer(tokens, len(request.get_tokens(0)))
        self.offered[request.request_id] = 0 if self.async_load and tokens > 0 else tokens
        self.answers[request.request_id] = (tokens, self.async_load and tokens > 0)
        return self.answers[request.request_id]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MemoryMeta:
        self.calls.append(("scheduler", "build_connector_meta", pickle.loads(pickle.dumps(scheduler_output))))
        meta = MemoryMeta()
        for first, data in [(True, d) for d in scheduler_output.new_requests] + [(False, d) for d in scheduler_output.cached_requests]:
            ids = [data.new_block_ids] if self._flat else data.new_block_ids_by_layer_group
            tracked = self.requests[data.request_id]
            if first:  # the first report restates the allocation's blocks, and the whole prompt
                assert tracked.blocks == ids and tracked.tokens == data.new_tokens, "first report disagrees with the allocation"
            else:
                tracked.tokens += data.new_tokens
                for g, delta in enumerate(ids):
                    tracked.blocks[g] += delta
            keys = chain_keys(tracked.tokens, self.tpb, tracked.salt)
            computed = data.computed_position + (self.offered.pop(data.request_id, 0) if first else 0)
            if first:
                for g, blocks in enumerate(tracked.blocks):
                    for ordinal, slot in valid_page_slots(blocks[: computed // self.tpb]):
                        meta.loads.append(Transfer(data.request_id, g, ordinal, slot, keys[ordinal]))
            done = computed + data.num_scheduled_tokens
            for ordinal in range(computed // self.tpb, done // self.tpb):
                for g, blocks in enumerate(tracked.blocks):
                    if blocks[ordinal] >= 0:
                        meta.saves.append(Transfer(data.request_id, g, ordinal, blocks[ordinal], keys[ordinal]))
        return meta

    def _after_alloc(self, method: str, request: Any, ids: list[list[int]]) -> None:
        self.calls.append(("scheduler", method, request.request_id, [list(g) for g in ids]))
        self.requests[request.request_id] = _Tracked(list(request.get_tokens(0)), [list(g) for g in ids], request.cache_salt)

    def _finished(self, method: str, request: Any, ids: list[list[int]]) -> bool:
        self.calls.append(("scheduler", method, request.request_id, [list(g) for g in ids]))
        del self.requests[request.request_id]
        return self.async_save


class MemoryScheduler(_SchedulerCore):
    """Implements the per-layer-group callback set (every model, VSWA included)."""

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        self._after_alloc("update_state_after_alloc_by_layer_group", request, block_ids_by_layer_group)

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        return self._finished("request_finished_by_layer_group", request, cache_block_ids_by_layer_group)


class FlatMemoryScheduler(_SchedulerCore):
    """Implements only the flat callback set (single layer group models)."""

    _flat = True

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self._after_alloc("update_state_after_alloc", request, [block_ids])

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self._finished("request_finished", request, [cache_block_ids])


class _WorkerCore:
    """Moves page bytes between the store and the pools; reports async completion ``report_delay`` polls late."""

    layout: KvCacheLayout

    def __init__(self, rank: int, store: MemoryStore, calls: list[Call], tokens_per_block: int, report_failures: bool,
                 report_delay: int = 1) -> None:
        self.rank, self.store, self.calls, self.tpb = rank, store, calls, tokens_per_block
        self.who = f"worker{rank}"
        self.meta = MemoryMeta()
        self.report_delay = report_delay
        """``get_finished`` reports an id this many polls after the one that passed it in."""
        self._failed: set[int] = set()
        self._due: list[tuple[int, list[int], list[int]]] = []
        self._polls = 0
        if not report_failures:  # hide the extension: the engine then never asks
            self.get_load_failures = None  # type: ignore[assignment]

    def _segments(self, group: int, slot: int) -> list[torch.Tensor]:
        return page_segments(self.layout.group(group), slot)

    def bind_connector_meta(self, meta: MemoryMeta) -> None:
        self.calls.append((self.who, "bind_connector_meta"))
        self.meta = meta

    def start_load_kv(self, stream: Any) -> None:
        self.calls.append((self.who, "start_load_kv", stream))
        for t in self.meta.loads:
            stored = self.store.pages[(self.rank, t.group, t.key)]
            for dst, src in zip(self._segments(t.group, t.slot), stored):
                dst.copy_(src)
                if t.key in self.store.corrupt:
                    dst.fill_(0x7F)
                    self._failed.add(t.request_id)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        self.calls.append((self.who, "wait_for_layer_load", layer_idx, stream))

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        self.calls.append((self.who, "save_kv_layer", layer_idx, stream))

    def wait_for_save(self, stream: Any) -> None:
        self.calls.append((self.who, "wait_for_save", stream))
        for t in self.meta.saves:
            if t.request_id in self._failed or (self.rank, t.group, t.key) in self.store.pages:
                continue
            segments = [s.clone() for s in self._segments(t.group, t.slot)]
            assert not all(bool((s == POISON_BYTE).all()) for s in segments), f"saving poisoned slot {t.slot}"
            self.store.pages[(self.rank, t.group, t.key)] = segments

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        self.calls.append((self.who, "get_finished", list(finished_gen_req_ids), list(started_loading_req_ids)))
        self._due.append((self._polls + self.report_delay, list(finished_gen_req_ids), list(started_loading_req_ids)))
        saved = [rid for due, ids, _ in self._due if due <= self._polls for rid in ids]
        loaded = [rid for due, _, ids in self._due if due <= self._polls for rid in ids]
        self._due = [d for d in self._due if d[0] > self._polls]
        self._polls += 1
        return saved, loaded

    def get_load_failures(self) -> list[int]:
        failed, self._failed = sorted(self._failed), set()
        self.calls.append((self.who, "get_load_failures", failed))
        return failed


class MemoryWorker(_WorkerCore):
    """Registers through ``register_kv_cache_layout`` (every cache shape)."""

    def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
        self.calls.append((self.who, "register_kv_cache_layout"))
        self.layout = layout


class FlatMemoryWorker(_WorkerCore):
    """Registers through ``register_kv_caches`` only (single-pool caches)."""

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self.calls.append((self.who, "register_kv_caches", tuple(kv_cache_tensor.shape)))
        self.layout = single_pool_layout(kv_cache_tensor, self.tpb)


@dataclass
class MemoryConnector:
    """Everything one connector instance consists of, plus the shared call log."""

    scheduler: _SchedulerCore
    workers: list[_WorkerCore]
    store: MemoryStore
    calls: list[Call]


def memory_connector(
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    store: Optional[MemoryStore] = None,
    flat: bool = False,
    flat_worker: bool = False,
    async_load: bool = False,
    async_save: bool = False,
    report_failures: bool = False,
    offer: Optional[Callable[[int, int], int]] = None,
) -> MemoryConnector:
    """A fresh scheduler and workers over ``store`` (a new one if ``None``), ready for ``ReferenceEngine``.

    ``offer(found_tokens, prompt_len)`` overrides what ``get_num_new_matched_tokens`` answers.
    """
    if store is None:
        store = MemoryStore(engine_cfg.tp_size, len(layer_groups_of(model_cfg)))
    calls: list[Call] = []
    sched_cls = FlatMemoryScheduler if flat else MemoryScheduler
    scheduler = sched_cls(store, engine_cfg.tokens_per_block, calls, async_load, async_save, offer)
    worker_cls = FlatMemoryWorker if flat_worker else MemoryWorker
    workers: list[_WorkerCore] = [
        worker_cls(rank, store, calls, engine_cfg.tokens_per_block, report_failures) for rank in range(engine_cfg.tp_size)
    ]
    return MemoryConnector(scheduler, workers, store, calls)
