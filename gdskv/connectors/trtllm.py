"""gdskv as a TensorRT-LLM KV Cache Connector: ``GdsKvScheduler`` (leader) and ``GdsKvWorker``.

Attach with::

    KvCacheConnectorConfig(connector_module="gdskv.connectors.trtllm",
                           connector_scheduler_class="GdsKvScheduler",
                           connector_worker_class="GdsKvWorker")

and ``kv_cache_config.enable_block_reuse=True``. Store settings come from gdskv's own config
(``GDSKV_CONFIG`` / ``GDSKV_STORE``, see ``gdskv.config``). Both classes are constructed as
``Cls(llm_args)`` and subclass TensorRT-LLM's bases when it is installed (``trtllm_base``).

Both are thin adapters: every decision is in ``gdskv.planner``; page bytes move only through
``gdskv.transfer.PageTransfer``. The scheduler implements both complete callback sets (flat and
per-layer-group); the worker both registrations (``register_kv_caches`` and
``register_kv_cache_layout``, any number of layer groups and regions).

How the scheduler finds the store namespaces it checks (one per TP rank): each worker derives its
``NamespaceSpec`` from the layout it is registered with and publishes it in a process-local
registry keyed by (store path, model, tp_size). The scheduler runs on rank 0, in the same process
as rank 0's worker, and takes that rank's spec; for a rank that did not register in this process
(real multi-process TP) it uses the same spec with that rank's ``tp_rank``: TensorRT-LLM splits KV
heads evenly, so every rank's page geometry is the same. If a rank's real geometry ever differed,
its namespace would differ too, and the lookup would find nothing there: a miss, never a wrong load.

Extension for the reference engine (TensorRT-LLM has no such hook): ``GdsKvWorker.get_load_failures``
lists requests whose loaded KV failed verification, so the engine recomputes them. Under TensorRT-LLM
a failed load is logged and counted; the scheduler checks presence at lookup, so it is rare.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from gdskv import streams
from gdskv.config import GdsKvConfig, load_config
from gdskv.connectors.trtllm_base import TRTLLM_AVAILABLE, KvCacheConnectorScheduler, KvCacheConnectorWorker
from gdskv.eviction import install_budget
from gdskv.garbage import collect_in_background
from gdskv.io import make_engine
from gdskv.layout import single_pool_layout
from gdskv.planner import (
    ConnectorMetadata,
    RequestPlan,
    RequestState,
    StepReport,
    new_request,
    plan_lookup,
    plan_step,
)
from gdskv.store import Namespace, NamespaceSpec, PageStore, StoreError
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus, page_segments

log = logging.getLogger(__name__)
LOOKUP_LEASE_SECONDS = 30.0
"""How long a lookup's served chunks are leased against eviction (any process's) so the load that
follows finds them: TensorRT-LLM cannot recompute a request whose promised load fails."""

DEFAULT_TOKENS_PER_BLOCK = 32
"""TensorRT-LLM's ``KvCacheConfig.tokens_per_block`` default, used when ``llm_args`` has none."""


class ConnectorSetupError(ValueError):
    """A configuration gdskv cannot serve, found at bring-up; the message names the setting."""


# --- what both halves read from llm_args ----------------------------------------------------------

def _attr(obj: Any, path: str) -> Any:
    """``obj.a.b`` for ``path="a.b"``, or None where any step is missing (dicts work too)."""
    for name in path.split("."):
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def _first_int(*values: Any) -> Optional[int]:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


@dataclass(frozen=True)
class Deployment:
    """The settings gdskv takes from ``llm_args``, checked at bring-up.

    Read: ``model`` (or ``model_id`` in the gdskv config), ``kv_cache_config.tokens_per_block``,
    ``kv_cache_config.enable_block_reuse``, ``max_beam_width``, ``pipeline_parallel_size``, the TP
    size (``mapping.tp_size``, ``tensor_parallel_size`` or ``parallel_config.tp_size``) and the TP
    rank (``mapping.tp_rank``; under TensorRT-LLM, the MPI rank modulo the TP size). Absent values
    default to a single rank and TensorRT-LLM's defaults.
    """

    model: str
    tokens_per_block: int
    tokens_per_block_given: bool
    tp_rank: int
    tp_size: int

    @classmethod
    def from_llm_args(cls, llm_args: Any, cfg: GdsKvConfig) -> "Deployment":
        beams = _first_int(_attr(llm_args, "max_beam_width"))
        if beams is not None and beams > 1:
            raise ConnectorSetupError(
                f"gdskv: max_beam_width={beams} is not supported: block keys cover beam 0 only; set max_beam_width=1"
            )
        reuse = _attr(llm_args, "kv_cache_config.enable_block_reuse")
        if reuse is False:
            raise ConnectorSetupError(
                "gdskv: kv_cache_config.enable_block_reuse is False; a connector's prefix is only honoured with "
                "block reuse: set kv_cache_config.enable_block_reuse=True"
            )
        pp = _first_int(_attr(llm_args, "pipeline_parallel_size"), _attr(llm_args, "parallel_config.pp_size"))
        if pp is not None and pp > 1:
            raise ConnectorSetupError(
                f"gdskv: pipeline_parallel_size={pp} is not supported (the scheduler on rank 0 cannot check the other "
                "stages' shards); use pipeline_parallel_size=1"
            )
        model = cfg.model_id or _attr(llm_args, "model")
        if not model:
            raise ConnectorSetupError("gdskv: no model identity: llm_args.model is empty and model_id is not set in the gdskv config")
        tpb = _first_int(_attr(llm_args, "kv_cache_config.tokens_per_block"))
        if tpb is not None and tpb < 1:
            raise ConnectorSetupError(f"gdskv: kv_cache_config.tokens_per_block={tpb} must be >= 1")
        size = _first_int(_attr(llm_args, "mapping.tp_size"), _attr(llm_args, "tensor_parallel_size"), _attr(llm_args, "parallel_config.tp_size")) or 1
        rank = _first_int(_attr(llm_args, "mapping.tp_rank"))
        if rank is None:
            rank = _mpi_rank() % size
        if not 0 <= rank < size:
            raise ConnectorSetupError(f"gdskv: mapping.tp_rank={rank} is outside tensor_parallel_size={size}")
        return cls(str(model), tpb or DEFAULT_TOKENS_PER_BLOCK, tpb is not None, rank, size)


def _mpi_rank() -> int:
    if TRTLLM_AVAILABLE:
        from tensorrt_llm._utils import mpi_rank  # type: ignore[import-not-found]

        return int(mpi_rank())
    return 0


@dataclass
class StandaloneLlmArgs:
    """The part of TensorRT-LLM's ``llm_args`` gdskv reads, for engines without TensorRT-LLM (the
    reference engine, ``gdskv demo``, tests). ``mapping`` carries the TP rank and size."""

    model: str
    kv_cache_config: "StandaloneKvCacheConfig"
    mapping: "StandaloneMapping"
    max_beam_width: int = 1

    @classmethod
    def build(cls, model: str, tokens_per_block: int, tp_rank: int = 0, tp_size: int = 1) -> "StandaloneLlmArgs":
        return cls(model, StandaloneKvCacheConfig(tokens_per_block), StandaloneMapping(tp_rank, tp_size))


@dataclass
class StandaloneKvCacheConfig:
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    enable_block_reuse: bool = True


@dataclass
class StandaloneMapping:
    tp_rank: int = 0
    tp_size: int = 1


# --- the process-local registry workers publish their namespaces in ------------------------------

@dataclass
class _Peers:
    """What the workers of one deployment in this process share with its scheduler."""

    specs: dict[int, NamespaceSpec] = field(default_factory=dict)
    failed: dict[int, set[int]] = field(default_factory=dict)
    """Step number -> request ids whose load failed on some rank in that step."""


_PEERS: dict[tuple[str, str, int], _Peers] = {}
_PEERS_LOCK = threading.Lock()


def _peers(store_path: str, model: str, tp_size: int) -> _Peers:
    """The registry entry of one deployment; taken by both halves' constructors."""
    with _PEERS_LOCK:
        return _PEERS.setdefault((store_path, model, tp_size), _Peers())


# --- layout checks ---------------------------------------------------------------------------------

def _region_tensors(layout: Any) -> list[Any]:
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
    tpb = _first_int(getattr(layout, "tokens_per_block", None))
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


# --- the scheduler ---------------------------------------------------------------------------------

@dataclass
class SchedulerCounters:
    """Hit/miss counters of the scheduler (lookups and what it planned)."""

    lookups: int = 0
    lookup_tokens: int = 0
    """Prompt tokens asked about."""
    matched_tokens: int = 0
    """Tokens ``get_num_new_matched_tokens`` offered."""
    loads_planned: int = 0
    saves_planned: int = 0
    store_errors: int = 0


class GdsKvScheduler(KvCacheConnectorScheduler):
    """The leader half: lookups, per-request state, and the metadata each step's workers execute.

    Constructed once on rank 0 by the runtime as ``GdsKvScheduler(llm_args)``. Inactive (serving
    nothing, saving nothing, with one log line) until a worker of this process has registered a
    layout, or when the store cannot be opened.
    """

    def __init__(self, llm_args: Any, config: Optional[GdsKvConfig] = None):
        """TensorRT-LLM constructs it with ``llm_args`` alone (gdskv's settings then come from
        ``load_config()``); in-process callers (the reference engine's stacks) pass ``config``."""
        super().__init__(llm_args)
        self._cfg = config if config is not None else load_config()
        self._deployment = Deployment.from_llm_args(llm_args, self._cfg)
        self._peers = _peers(self._cfg.store_path, self._deployment.model, self._deployment.tp_size)
        self._namespaces: Optional[list[Namespace]] = None
        self._windows: list[Optional[int]] = []
        self._tokens_per_block = self._deployment.tokens_per_block
        self._requests: dict[int, RequestState] = {}
        self._step = 0
        self._warned_inactive = False
        self._last_flush = time.monotonic()
        self.counters = SchedulerCounters()

    # -- store --------------------------------------------------------------------------------
    def _resolve(self) -> bool:
        """Find every rank's namespace (once); False while that is not possible."""
        if self._namespaces is not None:
            return True
        with _PEERS_LOCK:
            specs = dict(self._peers.specs)
        if not specs:
            if not self._warned_inactive:
                log.warning("gdskv: no connector worker has registered a KV cache layout in this process yet; serving nothing")
                self._warned_inactive = True
            return False
        base = specs[min(specs)]
        try:
            store = PageStore.from_config(self._cfg)
            self._namespaces = [store.namespace(specs.get(r) or base.with_rank(r)) for r in range(self._deployment.tp_size)]
        except (OSError, StoreError) as e:
            self.counters.store_errors += 1
            if not self._warned_inactive:
                log.error("gdskv: store %s (store_path / GDSKV_STORE) is unusable: %s; serving nothing", self._cfg.store_path, e)
                self._warned_inactive = True
            return False
        self._tokens_per_block = base.tokens_per_block
        self._windows = [g.window_size for g in base.groups]  # dense ids in order (check_layout)
        log.info("gdskv: scheduler checks namespaces %s in %s", ", ".join(ns.id for ns in self._namespaces), self._cfg.store_path)
        return True

    def _stored(self, layer_group_id: int, keys: Sequence[bytes]) -> list[bool]:
        """The planner's ``stored`` predicate (lookups and save planning): whether every TP rank's
        shard of each key's chunk is in the store. A rank is asked only about keys the ranks
        before it hold."""
        present = [True] * len(keys)
        for ns in self._namespaces or ():
            todo = [i for i, p in enumerate(present) if p]
            if not todo:
                break
            for i, there in zip(todo, ns.contains_many(layer_group_id, [keys[i] for i in todo])):
                present[i] = there
        return present

    # -- callbacks ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Called once per KV allocation of ``request``: prompt tokens the store serves beyond the
        ``num_computed_tokens`` the device holds. Loads are synchronous with the forward pass
        (posted in ``start_load_kv``, awaited per layer), so the answer is never asynchronous, and
        never ``(0, True)``."""
        if not self._resolve():
            return 0, False
        rid = int(request.request_id)
        tokens = list(request.get_tokens(0))
        salt = getattr(request, "cache_salt", None)
        for attempt in (0, 1):
            lookup = plan_lookup(tokens, salt, self._tokens_per_block, num_computed_tokens, len(self._windows), self._stored)
            if self._lease(lookup.keys[lookup.first_block:lookup.end_block]) or attempt:
                break  # a chunk evicted between the presence check and its lease: plan again without it
        self._requests[rid] = new_request(rid, tokens, salt, self._tokens_per_block, len(self._windows), lookup)
        self.counters.lookups += 1
        self.counters.lookup_tokens += len(tokens)
        self.counters.matched_tokens += lookup.num_new_tokens
        shared = self._namespaces[0].counters  # what `gdskv stats` sums across processes
        shared.add("lookups")
        shared.add("lookup_tokens", len(tokens))
        shared.add("lookup_matched_tokens", lookup.num_new_tokens)
        log.debug("gdskv: request %d: %d of %d prompt tokens from the store", rid, lookup.num_new_tokens, len(tokens))
        return lookup.num_new_tokens, False

    def _lease(self, served: Sequence[bytes]) -> bool:
        """Lease every served chunk (all groups, all ranks) to the load that follows, so eviction
        in any process leaves them alone; False when one was gone by then."""
        ok = True
        for ns in self._namespaces or ():
            for g in range(len(self._windows)):
                ok = all(ns.lease_many(g, list(served), lease_seconds=LOOKUP_LEASE_SECONDS)) and ok
        return ok

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Flat form (single layer group): pages of the first chunk."""
        self.update_state_after_alloc_by_layer_group(request, [block_ids])

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        """Called after the lookup, once pages exist for the promised prefix and the first chunk."""
        state = self._requests.get(int(request.request_id))
        if state is not None:
            state.record_alloc(block_ids_by_layer_group)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Called every step before the forward pass: plan loads (a request's first report) and
        saves (blocks this step completes) from both ``new_requests`` and ``cached_requests``."""
        self._step += 1
        if not self._resolve():
            return ConnectorMetadata(step=self._step)
        now = time.monotonic()
        if now - self._last_flush >= self._cfg.stats_flush_seconds:
            self._last_flush = now
            self._namespaces[0].store.flush_stats()
        plans: list[RequestPlan] = []
        for first, entries in ((True, scheduler_output.new_requests), (False, scheduler_output.cached_requests)):
            for data in entries:
                plan = self._plan(data, first)
                if plan is not None and not plan.empty:
                    plans.append(plan)
        return ConnectorMetadata(tuple(plans), step=self._step)

    def _plan(self, data: Any, first: bool) -> Optional[RequestPlan]:
        """One ``RequestData`` of ``build_connector_meta`` through ``plan_step``. A first report
        without a lookup (or of a replayed request) starts fresh state; a cached entry without
        any state is not planned."""
        report = _report_of(data)
        state = self._requests.get(report.request_id)
        if first and (state is None or state.reported):
            state = new_request(report.request_id, report.new_tokens, report.cache_salt, self._tokens_per_block, len(self._windows))
            self._requests[report.request_id] = state
        if state is None:
            log.debug("gdskv: request %d reported as cached without a first report; not planned", report.request_id)
            return None
        plan = plan_step(state, report, first, self._windows, self._stored)
        self.counters.loads_planned += sum(len(ops) for ops in plan.loads.values())
        self.counters.saves_planned += sum(len(ops) for ops in plan.saves.values())
        return plan

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Flat form of ``request_finished_by_layer_group``."""
        return self.request_finished_by_layer_group(request, [cache_block_ids])

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Called when ``request`` completes. Nothing is saved here (every block was planned when it
        completed); returns True when saves were planned for it, so its pages stay allocated until
        every worker reports the request in ``get_finished``."""
        state = self._requests.pop(int(request.request_id), None)
        return state is not None and state.saves_planned > 0


def _report_of(data: Any) -> StepReport:
    """A ``RequestData`` (TensorRT-LLM's or the reference engine's, duck-typed) as a ``StepReport``;
    the flat ``new_block_ids`` stands in for group 0 where the per-group lists are absent."""
    by_group = getattr(data, "new_block_ids_by_layer_group", None) or [list(getattr(data, "new_block_ids", None) or [])]
    return StepReport(
        request_id=int(data.request_id),
        new_tokens=list(data.new_tokens or ()),
        new_block_ids_by_group=[list(ids) for ids in by_group],
        computed_position=int(data.computed_position),
        num_scheduled_tokens=int(data.num_scheduled_tokens),
        cache_salt=getattr(data, "cache_salt", None),
    )


# --- the worker --------------------------------------------------------------------------------------

@dataclass
class WorkerCounters:
    """Outcomes of this worker's transfers."""

    loads_posted: int = 0
    loads_loaded: int = 0
    loads_failed: int = 0
    saves_posted: int = 0
    saves_published: int = 0
    saves_existing: int = 0
    saves_dropped: int = 0
    saves_suppressed: int = 0
    """Saves not posted because the request's load failed in that step (its KV is not trusted)."""


class GdsKvWorker(KvCacheConnectorWorker):
    """The rank-local half: executes the step's metadata against this rank's KV pool.

    Constructed on every rank as ``GdsKvWorker(llm_args)``; registered once with the pool; then,
    per step, ``start_load_kv`` posts the loads, ``wait_for_layer_load(i)`` waits for the loads of
    layer ``i``'s group, ``save_kv_layer(i)`` posts a group's saves once its last layer has been
    computed (a page holds every layer of its group), ``wait_for_save`` makes sure every save is
    posted. No save blocks the step: saves finish in the background and are reported by
    ``get_finished``.

    Device ordering (``gdskv.streams``): a readiness recorded on the engine's stream when the slots
    are handed over (``start_load_kv`` for loads, the group's last ``save_kv_layer`` for saves) is
    what the transfer thread waits on before it writes (loads) or reads (saves) a page, so kernels
    queued before still see the slot as they left it. The engine's later kernels read a loaded page
    only after ``wait_for_layer_load`` saw its load complete (host order). A sliding-window page is
    saved from a snapshot taken in stream order, since the cache may reclaim and reuse the page
    once the window moves, before the save has read it.
    """

    def __init__(self, llm_args: Any, config: Optional[GdsKvConfig] = None):
        """TensorRT-LLM constructs it with ``llm_args`` alone (gdskv's settings then come from
        ``load_config()``); in-process callers (the reference engine's stacks) pass ``config``."""
        super().__init__(llm_args)
        self._cfg = config if config is not None else load_config()
        self._deployment = Deployment.from_llm_args(llm_args, self._cfg)
        self._peers = _peers(self._cfg.store_path, self._deployment.model, self._deployment.tp_size)
        self._layout: Any = None
        self._transfer: Optional[PageTransfer] = None
        self._group_layers: dict[int, frozenset[int]] = {}
        self._group_of_layer: dict[int, int] = {}
        """Model layer -> its layer group id (``layout.group_of_layer``, resolved once at registration
        rather than on every per-layer hook)."""
        self._windows: dict[int, Optional[int]] = {}
        self._device: Any = None
        """Where the pool lives (ordering on its current stream when the engine passes none)."""
        # this step
        self._step_meta: Optional[ConnectorMetadata] = None
        self._last_step = 0
        self._step_loads: dict[int, list[tuple[int, Future]]] = defaultdict(list)
        self._layers_done: set[int] = set()
        self._groups_posted: set[int] = set()
        # across steps
        self._loads: dict[int, list[Future]] = {}
        self._saves: dict[int, list[Future]] = {}
        self._awaiting_save: dict[int, None] = {}
        self._awaiting_load: dict[int, None] = {}
        self._load_failures: dict[int, None] = {}
        self.counters = WorkerCounters()

    @property
    def namespace(self) -> Optional[Namespace]:
        """The store namespace this rank saves to and loads from (None when inactive)."""
        return self._transfer.ns if self._transfer is not None else None

    # -- registration -------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """Called once at bring-up with the single pool ``[num_blocks, num_layers, kv_factor,
        block_size]`` (one layer group, full attention)."""
        self._register(single_pool_layout(kv_cache_tensor, self._deployment.tokens_per_block))

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Called once at bring-up with the pool described per layer group and region (TensorRT-LLM's
        ``KvCacheLayout`` or gdskv's, duck-typed). Refuses a layout it cannot describe."""
        self._register(layout)

    def _register(self, layout: Any) -> None:
        d = self._deployment
        check_layout(layout, d.tokens_per_block if d.tokens_per_block_given else None)
        spec = NamespaceSpec.from_layout(layout, model=d.model, tp_rank=d.tp_rank, tp_size=d.tp_size)
        self._layout = layout
        self._group_layers = {g.layer_group_id: frozenset(int(i) for i in g.layer_ids) for g in layout.groups}
        self._group_of_layer = {layer: gid for gid, layers in self._group_layers.items() for layer in layers}
        self._windows = {g.layer_group_id: g.window_size for g in layout.groups}
        self._device = layout.groups[0].regions[0].slot_tensor(0).device
        try:
            store = PageStore.from_config(self._cfg)
            ns = store.namespace(spec)
            install_budget(store, self._cfg)
            collect_in_background(store)
            others = [o.id for o in store.namespaces() if o.spec.model == spec.model and o.spec.tp_rank == d.tp_rank and o.id != ns.id]
        except StoreError as e:
            raise ConnectorSetupError(f"gdskv: store_path (GDSKV_STORE) {self._cfg.store_path}: {e}") from None
        except OSError as e:
            log.error("gdskv: store %s (store_path / GDSKV_STORE) is unusable: %s; this rank loads and saves nothing", self._cfg.store_path, e)
            return
        if others:
            log.info(
                "gdskv: rank %d uses namespace %s; the store's other namespace(s) %s for model %r have another geometry "
                "and are not served from", d.tp_rank, ns.id, ", ".join(others), spec.model,
            )
        engine = make_engine(self._cfg)
        engine.register_buffers(_region_tensors(layout))
        self._transfer = PageTransfer(ns, engine, threads=self._cfg.io_threads, stats_flush_seconds=self._cfg.stats_flush_seconds,
                                      auth_key=self._cfg.auth_key())
        with _PEERS_LOCK:
            self._peers.specs[d.tp_rank] = spec
        log.info("gdskv: rank %d/%d registered %d layer group(s) as namespace %s (I/O: %s)",
                 d.tp_rank, d.tp_size, len(layout.groups), ns.id, self._transfer.engine.describe())

    # -- one step -----------------------------------------------------------------------------
    def start_load_kv(self, stream: Any) -> None:
        """Start of the forward pass: post this step's loads (all groups) and reset step state."""
        meta = self._metadata if isinstance(self._metadata, ConnectorMetadata) else None
        if meta is not None and meta.step <= self._last_step:
            meta = None  # already executed: the runtime bound no new metadata this step
        self._step_meta = meta
        self._step_loads.clear()
        self._layers_done.clear()
        self._groups_posted.clear()
        if self._transfer is None or meta is None:
            return
        self._last_step = meta.step
        with _PEERS_LOCK:
            for step in [s for s in self._peers.failed if s < meta.step]:
                del self._peers.failed[step]
        ready = None
        for gid in self._group_layers:
            group = self._layout.group(gid)
            for rid, op in meta.loads_of_group(gid):
                if ready is None:  # kernels queued so far may still use the slots: loads wait for them
                    ready = streams.record_ready(stream, [self._device])
                fut = self._transfer.load_page(gid, op.key, page_segments(group, op.page_slot), ready=ready)
                self._step_loads[gid].append((rid, fut))
                self._loads.setdefault(rid, []).append(fut)
                self.counters.loads_posted += 1

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Before layer ``layer_idx`` computes: wait for the loads into its group's pages."""
        if self._layout is not None:
            self._finish_loads(self._group_of_layer[int(layer_idx)])

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """After layer ``layer_idx``'s compute is enqueued: once every layer of its group has been,
        post that group's saves."""
        if self._layout is None:
            return
        self._layers_done.add(int(layer_idx))
        gid = self._group_of_layer[int(layer_idx)]
        if self._group_layers[gid] <= self._layers_done:
            self._post_saves(gid, stream)

    def wait_for_save(self, stream: Any) -> None:
        """End of the forward pass: settle every load and post (enqueue) any save not yet posted,
        which is what the spec asks of it. Never waits for a save: those finish in the background
        and are reaped by ``get_finished``."""
        for gid in self._group_layers:
            self._finish_loads(gid)
            self._post_saves(gid, stream)

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """Ids whose saves (resp. loads) are complete, only among ids ever passed in here; the rest
        stay pending and are reported by a later call. A save is complete once its chunk is
        published (or found existing, or dropped)."""
        for rid in finished_gen_req_ids:
            self._awaiting_save[int(rid)] = None
        for rid in started_loading_req_ids:
            self._awaiting_load[int(rid)] = None
        self._settle(self._saves, self._count_save)
        self._settle(self._loads, None)  # counted when awaited, in _finish_loads
        saved = [rid for rid in self._awaiting_save if rid not in self._saves]
        loaded = [rid for rid in self._awaiting_load if rid not in self._loads]
        for rid in saved:
            del self._awaiting_save[rid]
        for rid in loaded:
            del self._awaiting_load[rid]
        return saved, loaded

    def get_load_failures(self) -> list[int]:
        """Reference-engine extension (TensorRT-LLM has no such hook): request ids whose loaded KV
        failed verification (missing or corrupt chunk) since the last call; the engine recomputes
        them. Called by the reference engine after ``wait_for_save``."""
        failed = list(self._load_failures)
        self._load_failures.clear()
        return failed

    def close(self) -> None:
        """Wait for in-flight transfers and write the counters (tests, the demo, shutdown)."""
        if self._transfer is not None:
            self._transfer.close()
            self._transfer.engine.close()
            self._transfer = None

    # -- internals ----------------------------------------------------------------------------
    def _finish_loads(self, gid: int) -> None:
        """Wait for this step's loads into group ``gid``; a load that is not LOADED fails its request."""
        for rid, fut in self._step_loads.pop(gid, []):
            if self._count_load(fut) is not LoadStatus.LOADED:
                self._load_failures[rid] = None
                if self._step_meta is not None:
                    with _PEERS_LOCK:
                        self._peers.failed.setdefault(self._step_meta.step, set()).add(rid)

    def _post_saves(self, gid: int, stream: Any) -> None:
        """Post group ``gid``'s saves of this step (once), skipping requests whose load failed in
        this step on any rank: their KV was computed on top of bytes that are not theirs."""
        meta = self._step_meta
        if gid in self._groups_posted or meta is None or self._transfer is None:
            return
        self._groups_posted.add(gid)
        ops = meta.saves_of_group(gid)
        if not ops:
            return
        with _PEERS_LOCK:
            failed = set(self._peers.failed.get(meta.step, ()))
        group = self._layout.group(gid)
        windowed = self._windows[gid] is not None
        ready = None
        for rid, op in ops:
            if rid in failed:
                self.counters.saves_suppressed += 1
                continue
            segments = page_segments(group, op.page_slot)
            if windowed:  # the cache may reuse this page before the save reads it: save a copy
                segments, page_ready = streams.snapshot(segments, stream, self._device)
            else:  # the layers' KV must be in memory before the transfer thread reads it
                if ready is None:
                    ready = streams.record_ready(stream, [self._device])
                page_ready = ready
            fut = self._transfer.save_page(gid, op.key, op.parent_key, segments, ready=page_ready)
            self._saves.setdefault(rid, []).append(fut)
            self.counters.saves_posted += 1

    @staticmethod
    def _settle(inflight: dict[int, list[Future]], count: Optional[Callable[[Future], Any]]) -> None:
        """Drop finished futures (counting their outcome once) and requests with none left."""
        for rid in list(inflight):
            pending = []
            for fut in inflight[rid]:
                if fut.done():
                    if count is not None:
                        count(fut)
                else:
                    pending.append(fut)
            if pending:
                inflight[rid] = pending
            else:
                del inflight[rid]

    def _count_save(self, fut: Future) -> None:
        exc = fut.exception()
        status = None if exc is not None else fut.result()
        if status is SaveStatus.PUBLISHED:
            self.counters.saves_published += 1
        elif status is SaveStatus.EXISTS:
            self.counters.saves_existing += 1
        else:
            self.counters.saves_dropped += 1
            if exc is not None:
                log.warning("gdskv: a save failed: %s", exc)

    def _count_load(self, fut: Future) -> Optional[LoadStatus]:
        exc = fut.exception()
        if exc is not None:
            log.warning("gdskv: a load failed: %s", exc)
            self.counters.loads_failed += 1
            return None
        status = fut.result()
        if status is LoadStatus.LOADED:
            self.counters.loads_loaded += 1
        else:
            self.counters.loads_failed += 1
            log.warning("gdskv: a load came back %s; the request's KV is recomputed where the engine can", status.value)
        return status
