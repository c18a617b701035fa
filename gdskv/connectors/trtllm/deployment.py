"""What the TensorRT-LLM connector takes from ``llm_args``, checked at bring-up, and the
process-local registry through which a deployment's workers tell its scheduler their namespaces.

``Deployment.from_llm_args`` reads TensorRT-LLM's ``llm_args`` (or ``StandaloneLlmArgs``, its
stand-in for engines without TensorRT-LLM) and refuses, naming the setting, what gdskv cannot
serve. ``peers`` is the registry: each worker publishes the ``NamespaceSpec`` it derived from its
layout; the scheduler, on rank 0 in the same process as rank 0's worker, takes it from there, and
ranks share which requests' loads failed in a step (so no rank saves KV computed on them): in
this process directly, with ranks in other processes through the store (``TaintBoard``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from gdskv.config import GdsKvConfig
from gdskv.connectors.trtllm.base import TRTLLM_AVAILABLE
from gdskv.store import NamespaceSpec, PageStore
from gdskv.store.taints import TaintBoard

DEFAULT_TOKENS_PER_BLOCK = 32
"""TensorRT-LLM's ``KvCacheConfig.tokens_per_block`` default, used when ``llm_args`` has none."""


class ConnectorSetupError(ValueError):
    """A configuration gdskv cannot serve, found at bring-up; the message names the setting."""


def _attr(obj: Any, path: str) -> Any:
    """``obj.a.b`` for ``path="a.b"``, or None where any step is missing (dicts work too)."""
    for name in path.split("."):
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def first_int(*values: Any) -> Optional[int]:
    """The first of ``values`` that is an ``int`` (not a ``bool``), else None."""
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
        """The deployment of ``llm_args``, or ``ConnectorSetupError`` naming the setting gdskv
        cannot serve (beam search, block reuse off, pipeline parallelism). Called by the
        scheduler and the worker at construction."""
        beams = first_int(_attr(llm_args, "max_beam_width"))
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
        pp = first_int(_attr(llm_args, "pipeline_parallel_size"), _attr(llm_args, "parallel_config.pp_size"))
        if pp is not None and pp > 1:
            raise ConnectorSetupError(
                f"gdskv: pipeline_parallel_size={pp} is not supported (the scheduler on rank 0 cannot check the other "
                "stages' shards); use pipeline_parallel_size=1"
            )
        model = cfg.model_id or _attr(llm_args, "model")
        if not model:
            raise ConnectorSetupError("gdskv: no model identity: llm_args.model is empty and model_id is not set in the gdskv config")
        tpb = first_int(_attr(llm_args, "kv_cache_config.tokens_per_block"))
        if tpb is not None and tpb < 1:
            raise ConnectorSetupError(f"gdskv: kv_cache_config.tokens_per_block={tpb} must be >= 1")
        size = first_int(_attr(llm_args, "mapping.tp_size"), _attr(llm_args, "tensor_parallel_size"), _attr(llm_args, "parallel_config.tp_size")) or 1
        rank = first_int(_attr(llm_args, "mapping.tp_rank"))
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
class Peers:
    """What the workers of one deployment in this process share with its scheduler. Thread-safe."""

    tp_size: int = 1
    specs: dict[int, NamespaceSpec] = field(default_factory=dict)
    """TP rank -> the namespace spec its worker registered."""
    tainted: dict[int, None] = field(default_factory=dict)
    """Request ids whose load failed on some rank: TensorRT-LLM has no hook to recompute them, so
    everything they compute from then on stands on KV that is not theirs, and none of it is
    saved, until the request finishes (or an engine that recomputes it collects the failure:
    ``get_load_failures``)."""
    board: Optional[TaintBoard] = None
    """Where ranks in other processes learn of those (``bind``): while some rank's worker is not
    in this process."""
    deployment: str = ""
    """The scheduler's deployment id, from the step's metadata (``bind``)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def publish(self, rank: int, spec: NamespaceSpec) -> None:
        """A worker registered ``spec`` (its store is usable)."""
        with self.lock:
            self.specs[rank] = spec

    def bind(self, deployment: str, store: PageStore) -> None:
        """A worker executes a step of ``deployment`` (its scheduler's id; empty: none) on
        ``store``: every step, a comparison once bound. While some rank's worker is not in this
        process, failures go through the store's ``TaintBoard``, whose stale markers the first
        binding sweeps."""
        with self.lock:
            if self.deployment == deployment:
                return
            fresh = self.board is None
            self.deployment = deployment
            if deployment and len(self.specs) < self.tp_size:
                self.board = self.board or TaintBoard(store.fs)
            board = self.board
        if fresh and board is not None:
            board.sweep()

    def leader_spec(self) -> Optional[NamespaceSpec]:
        """The spec of rank 0, the scheduler's; from the lowest registered rank (with rank 0) where
        rank 0 did not register in this process: TensorRT-LLM splits KV heads evenly, so every
        rank's page geometry is the same. None while no worker has registered."""
        with self.lock:
            if not self.specs:
                return None
            return self.specs.get(0) or self.specs[min(self.specs)].with_rank(0)

    def load_failed(self, request_id: int) -> None:
        """A load of ``request_id`` failed on some rank (a worker, as it finds out)."""
        with self.lock:
            self.tainted[request_id] = None
            board, deployment = self.board, self.deployment
        if board is not None:
            board.mark(deployment, request_id)

    def tainted_now(self) -> set[int]:
        """The requests none of whose KV may be saved (a worker, before it posts saves)."""
        with self.lock:
            out = set(self.tainted)
            board, deployment = self.board, self.deployment
        return out | board.marked(deployment) if board is not None else out

    def finished(self, request_id: int, settled: bool = True) -> None:
        """``request_id`` is finished and its saves settled (a worker's ``get_finished``), or the
        engine recomputes it from scratch (``get_load_failures``). ``settled=False``: finished
        only (the scheduler's ``request_finished``): ranks in other processes may still be
        posting its last step's saves, so its marker stays for them; a worker's ``get_finished``
        runs after the next forward pass, which every rank has entered, and removes it."""
        with self.lock:
            self.tainted.pop(request_id, None)
            board, deployment = self.board, self.deployment
        if board is not None and settled:
            board.clear(deployment, request_id)


_PEERS: dict[tuple[str, str, int], Peers] = {}
_PEERS_LOCK = threading.Lock()


def peers(store_path: str, model: str, tp_size: int) -> Peers:
    """The registry entry of one deployment; taken by both halves' constructors."""
    with _PEERS_LOCK:
        return _PEERS.setdefault((store_path, model, tp_size), Peers(tp_size))
