"""TensorRT-LLM's KV Cache Connector base classes, or stand-ins with the same surface.

When ``tensorrt_llm`` imports, ``KvCacheConnectorScheduler`` and ``KvCacheConnectorWorker`` are
TensorRT-LLM's own (``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector``, or
``tensorrt_llm._torch.pyexecutor.kv_cache_connector`` in older releases), so gdskv's connector
classes (``gdskv.connectors.trtllm``) are real TensorRT-LLM connectors. Where it does not (CPU
machines, the reference engine, tests), the abstract classes below stand in: same method names,
same signatures, same bookkeeping (``self._llm_args``, ``bind_connector_meta`` storing
``self._metadata``), and the same defaults for the per-layer-group and layout forms, written from
the public spec.

``TRTLLM_AVAILABLE`` says which world this is.
"""
from __future__ import annotations

import abc
from typing import Any, Optional

import torch

try:  # TensorRT-LLM >= the release that moved connectors into a package
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (  # type: ignore[import-not-found]
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
    )

    TRTLLM_AVAILABLE = True
except ImportError:
    try:  # older releases
        from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (  # type: ignore[import-not-found,no-redef]
            KvCacheConnectorScheduler,
            KvCacheConnectorWorker,
        )

        TRTLLM_AVAILABLE = True
    except ImportError:
        TRTLLM_AVAILABLE = False

if not TRTLLM_AVAILABLE:

    class KvCacheConnectorWorker(abc.ABC):  # type: ignore[no-redef]
        """Runs on every rank; executes the scheduler's metadata against the KV pool.

        The runtime calls, per step: ``bind_connector_meta(meta)``, ``start_load_kv(stream)``,
        then per layer ``wait_for_layer_load(i, stream)`` / compute / ``save_kv_layer(i, stream)``,
        then ``wait_for_save(stream)`` and ``get_finished(...)``. Once at bring-up it calls
        ``register_kv_cache_layout(layout)`` (or ``register_kv_caches(tensor)``).
        """

        def __init__(self, llm_args: Any):
            self._llm_args = llm_args
            self._metadata: Optional[object] = None

        def bind_connector_meta(self, metadata: object) -> None:
            """Called by the runtime each step with the scheduler's (unpickled) metadata."""
            self._metadata = metadata

        def get_connector_meta(self) -> Optional[object]:
            return self._metadata

        def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
            """The single pool, ``[num_blocks, num_layers, kv_factor, block_size]``. Not abstract:
            a worker that implements ``register_kv_cache_layout`` need not define it."""
            raise NotImplementedError(f"{type(self).__name__} implements neither register_kv_caches nor register_kv_cache_layout")

        def register_kv_cache_layout(self, layout: Any) -> None:
            """The pool described per layer group and region. Default: forward the single-pool
            tensor to ``register_kv_caches``, refusing a cache one tensor cannot describe."""
            tensor = layout.as_single_pool_tensor()
            if tensor is None:
                raise NotImplementedError(
                    f"{type(self).__name__} implements register_kv_caches only, and this KV cache is "
                    f"{len(layout.groups)} layer group(s) with {sum(len(g.regions) for g in layout.groups)} "
                    "region(s), which one tensor cannot describe: implement register_kv_cache_layout"
                )
            self.register_kv_caches(tensor)

        @abc.abstractmethod
        def start_load_kv(self, stream: Any) -> None:
            """Start this step's loads (the forward pass has not begun)."""

        @abc.abstractmethod
        def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
            """Return once layer ``layer_idx``'s KV is loaded; called before its compute."""

        @abc.abstractmethod
        def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
            """Layer ``layer_idx``'s compute has been enqueued; saves may start."""

        @abc.abstractmethod
        def wait_for_save(self, stream: Any) -> None:
            """End of the forward pass: every save is enqueued or complete on return."""

        @abc.abstractmethod
        def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
            """Ids (only among those ever passed in) whose saves / loads have finished."""

    class KvCacheConnectorScheduler(abc.ABC):  # type: ignore[no-redef]
        """Runs on the leader rank only; decides loads and saves and builds the step metadata."""

        def __init__(self, llm_args: Any):
            self._llm_args = llm_args

        @abc.abstractmethod
        def build_connector_meta(self, scheduler_output: Any) -> object:
            """Once per step, with the new and cached requests' deltas; returns picklable metadata."""

        @abc.abstractmethod
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            """Once per KV allocation: tokens the store serves beyond ``num_computed_tokens``."""

        def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
            """The request completed; True while an asynchronous save still reads its pages.
            Not abstract: implementing ``request_finished_by_layer_group`` instead is enough."""
            raise NotImplementedError(f"{type(self).__name__} implements neither request_finished nor request_finished_by_layer_group")

        def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
            """Pages allocated for the request's first chunk (flat, single layer group). Not
            abstract: implementing ``update_state_after_alloc_by_layer_group`` instead is enough."""
            raise NotImplementedError(f"{type(self).__name__} implements neither update_state_after_alloc nor update_state_after_alloc_by_layer_group")

        def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
            """Per-layer-group form; the default folds a single group back to the flat call."""
            if len(block_ids_by_layer_group) != 1:
                raise NotImplementedError(
                    f"{type(self).__name__} implements update_state_after_alloc only; this cache has "
                    f"{len(block_ids_by_layer_group)} layer groups"
                )
            self.update_state_after_alloc(request, block_ids_by_layer_group[0])

        def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
            """Per-layer-group form; the default folds a single group back to the flat call."""
            if len(cache_block_ids_by_layer_group) != 1:
                raise NotImplementedError(
                    f"{type(self).__name__} implements request_finished only; this cache has "
                    f"{len(cache_block_ids_by_layer_group)} layer groups"
                )
            return self.request_finished(request, cache_block_ids_by_layer_group[0])

        def wait_for_initialization(self) -> None:
            """Called once after construction; nothing to wait for by default."""


__all__ = ["KvCacheConnectorScheduler", "KvCacheConnectorWorker", "TRTLLM_AVAILABLE"]
