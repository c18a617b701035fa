"""vLLM's objects as gdskv's types: no vLLM import, no policy (duck-typed, so tests use fakes).

- ``store_config``: gdskv's own config, with ``kv_connector_extra_config`` overriding settings;
- ``namespace_spec``: the store namespace of one TP shard, from ``vllm_config`` and vLLM's
  ``KVCacheConfig`` (the same in the scheduler and the worker process, so both find the same
  chunks); refuses what gdskv cannot describe (more than one KV cache group, a group whose
  blocks vLLM frees below a window, pipeline or decode-context parallelism), naming the setting;
- ``PagePool``: a block id as the byte segments of its page (every layer's block, in the
  group's layer order), over the tensors ``register_kv_caches`` hands over;
- ``StepMeta``: what the scheduler side hands the workers each step (pickled by vLLM).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from gdskv.config import GdsKvConfig, load_config
from gdskv.planner import PageOp
from gdskv.store import GroupSpec, NamespaceSpec


class ConnectorSetupError(ValueError):
    """A configuration gdskv cannot serve, found at bring-up; the message names the setting."""


def _attr(obj: Any, path: str) -> Any:
    for name in path.split("."):
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
    return obj


def store_config(vllm_config: Any) -> GdsKvConfig:
    """gdskv's config (``load_config()``), with any gdskv setting named in
    ``kv_transfer_config.kv_connector_extra_config`` taking precedence (an unknown one is a
    ``ConfigError`` naming it)."""
    extra = dict(_attr(vllm_config, "kv_transfer_config.kv_connector_extra_config") or {})
    return load_config(**extra)


def namespace_spec(vllm_config: Any, kv_cache_config: Any, cfg: GdsKvConfig, tp_rank: int) -> NamespaceSpec:
    """The namespace of TP shard ``tp_rank``: model, dtype, block size, page bytes of the one
    full-attention KV cache group (every layer's block of one block id), TP rank/size, the KV
    layout and device type that decide how a page's bytes are arranged, and the attention
    window.

    Sliding-window and chunked-local layers beside full-attention ones (gpt-oss, Gemma, Llama 4)
    are served: without ``SupportsHMA`` vLLM allocates them as full attention (one
    ``FullAttentionSpec`` group recording ``sliding_window`` / ``attention_chunk_size``) and
    keeps every block of a request, so a prefix's blocks are whole. The window is part of the
    namespace: the same model run with ``--disable-sliding-window`` computes other KV. A group
    of local attention only (``SlidingWindowSpec``: vLLM frees its blocks below the window) is
    refused."""
    where = "gdskv (vLLM connector)"
    groups = list(_attr(kv_cache_config, "kv_cache_groups") or ())
    if len(groups) != 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups) or "none"
        raise ConnectorSetupError(
            f"{where}: the model has {len(groups)} KV cache groups ({kinds}); gdskv serves one full-attention group and does "
            "not implement vLLM's hybrid allocator interface (SupportsHMA): use a model with full attention in every layer")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec":
        raise ConnectorSetupError(f"{where}: KV cache spec {kind} is not supported; gdskv serves one group vLLM allocates as "
                                  "FullAttentionSpec (full attention, or local attention beside full-attention layers)")
    for setting in ("parallel_config.pipeline_parallel_size", "parallel_config.decode_context_parallel_size"):
        v = _attr(vllm_config, setting)
        if isinstance(v, int) and v > 1:
            raise ConnectorSetupError(f"{where}: {setting}={v} is not supported; use 1")
    tp_size = _attr(vllm_config, "parallel_config.tensor_parallel_size") or 1
    if not 0 <= tp_rank < tp_size:
        raise ConnectorSetupError(f"{where}: TP rank {tp_rank} is outside tensor_parallel_size={tp_size}")
    model = cfg.model_id or _attr(vllm_config, "model_config.model")
    if not model:
        raise ConnectorSetupError(f"{where}: no model identity: model_config.model is empty and model_id is not set in the gdskv config")
    layers = list(groups[0].layer_names)
    extra = {
        "engine": "vllm",
        "kv_layout": str(_attr(kv_cache_config, "kv_cache_layout") or "default"),
        "device": str(_attr(vllm_config, "device_config.device_type") or "unknown"),
        "layer_page_bytes": str(int(spec.page_size_bytes)),
    }
    for setting in ("sliding_window", "attention_chunk_size"):
        if getattr(spec, setting, None) is not None:
            extra[setting] = str(int(getattr(spec, setting)))
    revision = _attr(vllm_config, "model_config.revision")
    if revision:
        extra["revision"] = str(revision)
    group = GroupSpec(0, int(spec.page_size_bytes) * len(layers), tuple(range(len(layers))))
    return NamespaceSpec(model=str(model), dtype=str(spec.dtype).removeprefix("torch."), tokens_per_block=int(spec.block_size),
                         groups=(group,), tp_rank=tp_rank, tp_size=int(tp_size), extra=tuple(sorted(extra.items())))


def _bytes_of(view: torch.Tensor) -> torch.Tensor:
    """A block's tensor as the dense byte range it occupies (any order of its dims within it)."""
    if view.is_contiguous():
        return view.reshape(-1).view(torch.uint8)
    dims = sorted((s, n) for s, n in zip(view.stride(), view.shape) if n > 1)
    expect = 1
    for stride, n in dims:
        if stride != expect:
            raise ConnectorSetupError(f"gdskv (vLLM connector): a KV block of shape {tuple(view.shape)} with strides "
                                      f"{tuple(view.stride())} is not one dense byte range")
        expect *= n
    nbytes = view.numel() * view.element_size()
    out = torch.empty(0, dtype=torch.uint8, device=view.device)
    return out.set_(view.untyped_storage(), view.storage_offset() * view.element_size(), (nbytes,), (1,))


class PagePool:
    """The KV pool ``register_kv_caches`` hands over, addressed by block id.

    A layer's tensor has one dimension of ``num_blocks`` (the block dimension: the first such
    of the first two); a block of a layer is one byte range per index of the dimensions before
    it (CPU: ``(num_blocks, heads, block_size, 2 * head_size)``, one range; CUDA flash
    attention: ``(2, num_blocks, ...)``, a K and a V range). A page is every layer's ranges in
    the KV cache group's layer order."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int, layer_page_bytes: int):
        self.layers: list[tuple[torch.Tensor, int]] = []
        for name in layer_names:
            if name not in kv_caches:
                raise ConnectorSetupError(f"gdskv (vLLM connector): register_kv_caches has no tensor for layer {name!r}")
            t = kv_caches[name]
            dims = [d for d in range(min(2, t.dim())) if t.shape[d] == num_blocks]
            if not dims:
                raise ConnectorSetupError(f"gdskv (vLLM connector): layer {name!r}: KV tensor of shape {tuple(t.shape)} has no "
                                          f"leading dimension of num_blocks={num_blocks}")
            self.layers.append((t, dims[0]))
            got = sum(s.numel() for s in self._block(t, dims[0], 0))
            if got != layer_page_bytes:
                raise ConnectorSetupError(f"gdskv (vLLM connector): layer {name!r}: a block is {got} bytes, the KV cache spec "
                                          f"says page_size_bytes={layer_page_bytes}")
        self.num_blocks = num_blocks
        self.device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")

    @staticmethod
    def _block(t: torch.Tensor, dim: int, block_id: int) -> list[torch.Tensor]:
        return [_bytes_of(t[idx + (block_id,)]) for idx in itertools.product(*(range(n) for n in t.shape[:dim]))]

    def segments(self, block_id: int) -> list[torch.Tensor]:
        """The page of ``block_id``; ``IndexError`` outside the pool (-1 never aliases a block)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside the KV pool of {self.num_blocks} blocks")
        return [s for t, dim in self.layers for s in self._block(t, dim, block_id)]


@dataclass
class StepMeta:
    """One step's work for the workers: loads and saves per request (ops of layer group 0: the
    block id is the page slot), requests the scheduler holds until their saves finish
    (``request_finished`` returned True), and requests preempted this step (their in-flight
    saves must finish before vLLM reuses their blocks)."""

    step: int = 0
    loads: list[tuple[str, tuple[PageOp, ...]]] = field(default_factory=list)
    saves: list[tuple[str, tuple[PageOp, ...]]] = field(default_factory=list)
    held: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves or self.held or self.preempted)


def block_ids_of(blocks: Any) -> list[list[int]]:
    """vLLM's ``KVCacheBlocks`` (or a tuple of block id lists) as one list per group."""
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    return [list(g) for g in (ids or ())]


def tokens_of(request: Any) -> Optional[list[int]]:
    """A request's tokens so far (prompt and output); None for a prompt given as embeddings."""
    if getattr(request, "prompt_token_ids", ()) is None:
        return None
    return list(request.all_token_ids)
