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

The package: ``wire`` (the metadata workers execute, the engine's step reports), ``lookup`` (what
can be served), ``requests`` (per-request state and one step's plan), ``shards`` (engines that
name their blocks themselves).
"""
from gdskv.planner.lookup import (Lookup, contiguous_hits, first_live_block, loads_async, lookup_needs, max_servable_blocks,
                                  plan_lookup, plan_lookup_window_aware, window_blocks, window_keep_from)
from gdskv.planner.requests import RequestState, new_request, plan_step, take_promised_loads
from gdskv.planner.shards import HolderFn, held_everywhere, plan_offload, shard_routes, store_shards
from gdskv.planner.wire import ConnectorMetadata, PageOp, RequestPlan, Salt, StepReport, StoredFn

__all__ = ["ConnectorMetadata", "HolderFn", "Lookup", "PageOp", "RequestPlan", "RequestState", "Salt", "StepReport", "StoredFn",
           "contiguous_hits", "first_live_block", "held_everywhere", "loads_async", "lookup_needs", "max_servable_blocks", "new_request",
           "plan_lookup", "plan_lookup_window_aware", "plan_offload", "plan_step", "shard_routes", "store_shards",
           "take_promised_loads", "window_blocks", "window_keep_from"]
