"""The worker's registration checks of a TensorRT-LLM ``KvCacheLayout`` (or gdskv's, duck-typed):
``check_layout`` refuses, naming the attribute, a layout gdskv cannot describe as store chunks;
``region_tensors`` are the tensors over its regions, for the I/O engine's buffer registration."""
from __future__ import annotations

from typing import Any, Optional

from gdskv.connectors.trtllm.deployment import ConnectorSetupError, first_int


def region_tensors(layout: Any) -> list[Any]:
    """The tensors over a layout's regions, for ``IoEngine.register_buffers``; regions that
    describe memory gdskv cannot view (TensorRT-LLM's own raw addresses) are left out."""
    out = []
    for g in layout.groups:
        for r in g.regions:
            try:
                out.append(r.as_tensor())
            except (AttributeError, RuntimeError, ValueError):
                continue
    return out


def check_layout(layout: Any, expected_tokens_per_block: Optional[int]) -> None:
    """Refuse, naming the attribute, a layout gdskv cannot describe as store chunks.

    Called by the worker's registration, before anything touches the store.
    """
    where = "register_kv_cache_layout"
    if getattr(layout, "dtype", None) is None:
        raise ConnectorSetupError(f"{where}: the layout has no dtype (layout.dtype); gdskv needs it for the store namespace")
    tpb = first_int(getattr(layout, "tokens_per_block", None))
    if tpb is None or tpb < 1:
        raise ConnectorSetupError(f"{where}: layout.tokens_per_block={tpb!r} must be a positive integer")
    if expected_tokens_per_block is not None and tpb != expected_tokens_per_block:
        raise ConnectorSetupError(
            f"{where}: layout.tokens_per_block={tpb} but kv_cache_config.tokens_per_block={expected_tokens_per_block}"
        )
    groups = list(getattr(layout, "groups", None) or ())
    if not groups:
        raise ConnectorSetupError(f"{where}: the layout has no layer groups (layout.groups is empty)")
    seen_layers: dict[int, int] = {}
    for index, g in enumerate(groups):
        gid = g.layer_group_id
        if gid != index:
            raise ConnectorSetupError(f"{where}: layout.groups[{index}].layer_group_id={gid}; layer group ids must be dense from 0 in order")
        window = g.window_size
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ConnectorSetupError(f"{where}: layer group {gid}: window_size={window!r} must be None or a positive integer")
        if not g.layer_ids:
            raise ConnectorSetupError(f"{where}: layer group {gid} has no layers (layer_ids is empty)")
        for layer in g.layer_ids:
            if layer in seen_layers:
                raise ConnectorSetupError(f"{where}: layer {layer} is in layer groups {seen_layers[layer]} and {gid}")
            seen_layers[layer] = gid
        regions = list(g.regions)
        if not regions:
            raise ConnectorSetupError(f"{where}: layer group {gid} has no regions (group.regions is empty)")
        separate = [r for r in getattr(g, "replicated_regions", ()) if not isinstance(r, int)]
        if separate:
            raise ConnectorSetupError(
                f"{where}: layer group {gid} has {len(separate)} replicated region(s) outside group.regions "
                "(a side cache identical on every shard); gdskv stores group.regions only and cannot describe them"
            )
        slots = {r.num_slots for r in regions}
        if len(slots) != 1 or min(slots) < 1:
            raise ConnectorSetupError(f"{where}: layer group {gid}: regions disagree on num_slots {sorted(slots)} or have none")
        for i, r in enumerate(regions):
            if r.size < 1:
                raise ConnectorSetupError(f"{where}: layer group {gid} region {i}: size={r.size} must be positive")
            if r.num_slots > 1 and r.stride < r.size:
                raise ConnectorSetupError(
                    f"{where}: layer group {gid} region {i}: size={r.size} does not fit in stride={r.stride} (slots would overlap)"
                )
            if not callable(getattr(r, "slot_tensor", None)):
                raise ConnectorSetupError(f"{where}: layer group {gid} region {i} has no slot_tensor (KvCacheRegion.slot_tensor)")
            try:
                r.slot_tensor(0)
            except (RuntimeError, ValueError) as e:
                raise ConnectorSetupError(f"{where}: layer group {gid} region {i} cannot be viewed as a tensor (region.slot_tensor): {e}") from None
        total = sum(r.size for r in regions)
        if g.bytes_per_page != total:
            raise ConnectorSetupError(
                f"{where}: layer group {gid}: bytes_per_page={g.bytes_per_page} but its regions cover {total} bytes"
            )

