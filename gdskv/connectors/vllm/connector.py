"""``GdsKvConnector``: vLLM's ``KVConnectorBase_V1`` over gdskv's KV cache service.

vLLM builds it twice (``kv_role="kv_both"``): with ``role=SCHEDULER`` in the EngineCore process
(lookups, per-request state, the step's metadata: ``scheduler.SchedulerSide``) and with
``role=WORKER`` in each worker process (page loads and saves: ``worker.WorkerSide``). Every
method delegates to one of them; this module only imports vLLM and translates call shapes.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from gdskv.connectors.vllm.scheduler import SchedulerSide
from gdskv.connectors.vllm.translate import StepMeta, namespace_spec, store_config
from gdskv.connectors.vllm.worker import WorkerSide
from gdskv.service import KvService

log = logging.getLogger(__name__)


class GdsKvMetadata(StepMeta, KVConnectorMetadata):
    """``StepMeta`` as the ``KVConnectorMetadata`` vLLM passes from scheduler to workers."""


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):  # no TP group in this process: a single rank
        return 0


class GdsKvConnector(KVConnectorBase_V1):
    """gdskv's persistent KV cache for vLLM: prefix blocks are loaded from the store
    asynchronously, every full block is saved as soon as it is computed."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = store_config(vllm_config)
        group = kv_cache_config.kv_cache_groups[0] if kv_cache_config is not None and kv_cache_config.kv_cache_groups else None
        rank = 0 if role == KVConnectorRole.SCHEDULER else _tp_rank()
        spec = namespace_spec(vllm_config, kv_cache_config, cfg, rank)
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(KvService(cfg, spec, transfers=False, served_by="vllm"))
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
                log.warning('gdskv: kv_load_failure_policy is %r: a block that fails to load from the store fails its request; '
                            'add "kv_load_failure_policy":"recompute" to --kv-transfer-config to recompute it instead',
                            self._kv_transfer_config.kv_load_failure_policy)
        else:
            self._worker = WorkerSide(KvService(cfg, spec, served_by="vllm"), list(group.layer_names), int(kv_cache_config.num_blocks),
                                      int(group.kv_cache_spec.page_size_bytes))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost hand-off

    # -- scheduler role -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = self._scheduler.build_meta(scheduler_output)
        return GdsKvMetadata(meta.step, meta.loads, meta.saves, meta.held, meta.preempted)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler.finished(request), None

    # -- worker role --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._worker.start_loads(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once they are reported finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a page holds every layer's block: saved once the step's forward pass is done

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.post_saves(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return self._worker.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    # -- both -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.service.close()
