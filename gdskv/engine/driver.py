"""How the reference engine drives a TensorRT-LLM-style KV cache connector: ``ConnectorDriver``
checks a scheduler and its workers at bring-up (the callback set, the layout registration) and
makes the spec's calls for ``ReferenceEngine``'s step loop (``gdskv.engine.runtime``), keeping
what every rank has reported."""
from __future__ import annotations

import logging
import pickle
from typing import Any, Sequence

from gdskv.engine.requests import EngineRequest, SchedulerOutput
from gdskv.layout import KvCacheLayout

log = logging.getLogger(__name__)

FLAT_CALLBACKS = ("update_state_after_alloc", "request_finished")
PER_GROUP_CALLBACKS = ("update_state_after_alloc_by_layer_group", "request_finished_by_layer_group")
SCHEDULER_METHODS = ("get_num_new_matched_tokens", "build_connector_meta")
SPEC_BASE_CLASSES = ("KvCacheConnectorScheduler", "KvCacheConnectorWorker")
"""The spec's base classes (TensorRT-LLM's, or a stand-in of the same name): their methods are defaults."""
WORKER_METHODS = ("bind_connector_meta", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished")


class ConnectorError(RuntimeError):
    """A connector cannot run on this cache (raised at bring-up) or broke the protocol."""


def _missing(obj: Any, names: Sequence[str]) -> list[str]:
    return [n for n in names if not callable(getattr(obj, n, None))]


def _implements(obj: Any, name: str) -> bool:
    """Whether ``obj`` implements ``name`` itself rather than inheriting a spec base-class default.

    A connector subclassing TensorRT-LLM's base classes inherits every callback, the
    per-layer-group forms and ``register_kv_cache_layout`` included; only an override counts as
    implementing one. Duck-typed objects implement what they define.
    """
    if callable(getattr(obj, "__dict__", {}).get(name)):
        return True
    for cls in type(obj).__mro__:
        if name in vars(cls):
            return cls.__name__ not in SPEC_BASE_CLASSES and callable(vars(cls)[name])
    return False


def _not_implemented(obj: Any, names: Sequence[str]) -> list[str]:
    return [n for n in names if not _implements(obj, n)]


class ConnectorDriver:
    """One scheduler (leader) and one worker per TP rank, checked at bring-up and called in spec order.

    Built by ``ReferenceEngine.__init__``; every later method is called by the engine's step loop.
    Bring-up, before any request: the scheduler uses the per-layer-group callback set when it
    implements both of its methods (also when it implements both sets), else the flat set, which a
    cache of more than one layer group refuses; one method from each set is refused, naming the
    missing one. A method inherited from a class named like the spec's base classes is a default,
    not an implementation. Each worker gets ``register_kv_cache_layout(layout)`` if it implements
    it, else ``register_kv_caches(layout.as_single_pool_tensor())``, refused (naming the group and
    region counts) when the cache is not one tensor.
    """

    def __init__(self, scheduler: Any, workers: Sequence[Any], layouts: Sequence[KvCacheLayout]) -> None:
        if len(workers) != len(layouts):
            raise ConnectorError(f"{len(workers)} connector workers for tp_size={len(layouts)}: one worker per rank")
        for what, obj, names in [("scheduler", scheduler, SCHEDULER_METHODS)] + [("worker", w, WORKER_METHODS) for w in workers]:
            if missing := _missing(obj, names):
                raise ConnectorError(f"connector {what} {type(obj).__name__} lacks {', '.join(missing)}")
        self.scheduler, self.workers = scheduler, list(workers)
        self.num_groups = len(layouts[0].groups)
        self.per_group = self._choose_callback_set(layouts[0])
        for rank, (worker, layout) in enumerate(zip(self.workers, layouts)):
            self._register(rank, worker, layout)
        self._save_reports: dict[int, set[int]] = {}
        self._load_reports: dict[int, set[int]] = {}

    # -- bring-up ---------------------------------------------------------------------------

    def _choose_callback_set(self, layout: KvCacheLayout) -> bool:
        """True for the per-layer-group set, False for the flat one; refuse anything else."""
        name = type(self.scheduler).__name__
        missing_group = _not_implemented(self.scheduler, PER_GROUP_CALLBACKS)
        missing_flat = _not_implemented(self.scheduler, FLAT_CALLBACKS)
        if not missing_group:
            return True
        if missing_flat:
            raise ConnectorError(
                f"connector scheduler {name} implements no complete callback set: the per-layer-group set lacks "
                f"{', '.join(missing_group)} and the flat set lacks {', '.join(missing_flat)}; implement exactly one complete set"
            )
        if self.num_groups > 1:
            raise ConnectorError(
                f"the KV cache has {self.num_groups} layer groups (windows "
                f"{[g.window_size for g in layout.groups]}) and connector scheduler {name} implements only the flat "
                f"callbacks; it lacks {', '.join(missing_group)}"
            )
        if len(missing_group) == 1:
            raise ConnectorError(
                f"connector scheduler {name} mixes the callback sets: it defines "
                f"{[m for m in PER_GROUP_CALLBACKS if m not in missing_group][0]} but lacks {missing_group[0]}"
            )
        window = layout.groups[0].window_size
        if window is not None:
            log.warning("flat-only connector %s on a model with sliding window %d: block lists cover the live window only", name, window)
        return False

    @staticmethod
    def _register(rank: int, worker: Any, layout: KvCacheLayout) -> None:
        """``register_kv_cache_layout`` where the worker implements it, else the single-pool tensor."""
        if _implements(worker, "register_kv_cache_layout"):
            worker.register_kv_cache_layout(layout)
            return
        tensor = layout.as_single_pool_tensor()
        if tensor is None:
            raise ConnectorError(
                f"connector worker {type(worker).__name__} (rank {rank}) has no register_kv_cache_layout, and a cache of "
                f"{len(layout.groups)} layer groups with {[len(g.regions) for g in layout.groups]} regions cannot be "
                f"described as one tensor for register_kv_caches"
            )
        worker.register_kv_caches(tensor)

    # -- scheduler callbacks ------------------------------------------------------------------

    def matched_tokens(self, request: EngineRequest) -> tuple[int, bool]:
        """The connector's offer for a freshly admitted request, validated."""
        answer = self.scheduler.get_num_new_matched_tokens(request, 0)
        try:
            num_tokens, is_async = answer
        except (TypeError, ValueError):
            raise ConnectorError(f"get_num_new_matched_tokens returned {answer!r}, not (num_tokens, is_async)") from None
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ConnectorError(f"get_num_new_matched_tokens returned num_tokens={num_tokens!r} for request {request.request_id}")
        if num_tokens == 0 and is_async:
            raise ConnectorError(
                f"get_num_new_matched_tokens returned (0, True) for request {request.request_id}: nothing to load asynchronously"
            )
        return num_tokens, bool(is_async)

    def after_alloc(self, request: EngineRequest) -> None:
        """At admission, once the loaded prefix and first chunk have pages: the chosen set's
        ``update_state_after_alloc`` form."""
        ids = [list(g) for g in request.block_ids]
        if self.per_group:
            self.scheduler.update_state_after_alloc_by_layer_group(request, ids)
        else:
            self.scheduler.update_state_after_alloc(request, ids[0])

    def request_finished(self, request: EngineRequest) -> bool:
        """When a request completes: the chosen set's ``request_finished`` form; True while a save
        still reads its pages."""
        ids = [list(g) for g in request.block_ids]
        if self.per_group:
            return bool(self.scheduler.request_finished_by_layer_group(request, ids))
        return bool(self.scheduler.request_finished(request, ids[0]))

    # -- worker calls, one step ---------------------------------------------------------------

    def begin_step(self, output: SchedulerOutput) -> None:
        """Before the forward pass: build the step's metadata, hand every worker its own copy,
        start the loads."""
        meta = pickle.dumps(self.scheduler.build_connector_meta(output))
        for worker in self.workers:
            worker.bind_connector_meta(pickle.loads(meta))
            worker.start_load_kv(None)

    def before_layer(self, layer: int) -> None:
        for worker in self.workers:
            worker.wait_for_layer_load(layer, None)

    def after_layer(self, layer: int) -> None:
        for worker in self.workers:
            worker.save_kv_layer(layer, None)

    def end_forward(self) -> set[int]:
        """``wait_for_save`` on every worker, then the (extension) load failures of any rank."""
        for worker in self.workers:
            worker.wait_for_save(None)
        return self.load_failures()

    def load_failures(self) -> set[int]:
        """The (extension) ``get_load_failures`` of every rank that has it, together."""
        failed: set[int] = set()
        for worker in self.workers:
            if callable(getattr(worker, "get_load_failures", None)):
                failed.update(int(i) for i in worker.get_load_failures())
        return failed

    def poll_finished(self, finished_gen: list[int], started_loading: list[int]) -> tuple[set[int], set[int]]:
        """``get_finished`` on every worker, once per step: ids every rank has now reported
        finished saving, and finished loading."""
        for rank, worker in enumerate(self.workers):
            saved, loaded = worker.get_finished(list(finished_gen), list(started_loading))
            for reports, ids in ((self._save_reports, saved), (self._load_reports, loaded)):
                for rid in ids:
                    reports.setdefault(int(rid), set()).add(rank)
        return self._reported_by_every_rank(self._save_reports), self._reported_by_every_rank(self._load_reports)

    def forget(self, request_id: int) -> None:
        """Drop partial reports of a request that is gone."""
        self._save_reports.pop(request_id, None)
        self._load_reports.pop(request_id, None)

    def _reported_by_every_rank(self, reports: dict[int, set[int]]) -> set[int]:
        """Take the ids every rank has reported out of ``reports``."""
        done = {rid for rid, ranks in reports.items() if len(ranks) == len(self.workers)}
        for rid in done:
            del reports[rid]
        return done

