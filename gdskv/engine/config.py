"""Configuration of the reference engine: the model it runs and the KV cache it runs it on.

Built by whoever starts a ``ReferenceEngine`` (tests, ``gdskv demo``, ``gdskv prewarm``); read by
the model (``ModelConfig``), the paged KV cache and the scheduler loop (``EngineConfig``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch


@dataclass(frozen=True)
class ModelConfig:
    """A small decoder-only transformer with deterministic random weights.

    ``attention_windows`` gives each layer's window (``None`` = full attention, ``int`` = the
    number of most recent tokens a query attends to, itself included). It is cycled over the
    layers, as TensorRT-LLM cycles ``max_attention_window``; empty means full attention
    everywhere. ``dtype`` is the weight and activation type; ``kv_dtype`` the type the KV pool
    stores (defaults to ``dtype``).
    """

    vocab_size: int = 97
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    intermediate_size: int = 64
    attention_windows: tuple[Optional[int], ...] = ()
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 0
    dtype: torch.dtype = torch.float32
    kv_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        for w in self.attention_windows:
            if w is not None and w < 1:
                raise ValueError(f"attention window {w} must be None or >= 1")

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type of the KV pool."""
        return self.kv_dtype if self.kv_dtype is not None else self.dtype

    def window_of_layer(self, layer: int) -> Optional[int]:
        """The attention window of ``layer`` (``None`` = full attention)."""
        if not self.attention_windows:
            return None
        return self.attention_windows[layer % len(self.attention_windows)]

    def fingerprint(self) -> str:
        """A stable identity of the weights and KV geometry, e.g. for a store namespace's model name."""
        windows = ",".join("full" if self.window_of_layer(i) is None else str(self.window_of_layer(i)) for i in range(self.num_layers))
        text = (
            f"v{self.vocab_size} h{self.hidden_size} l{self.num_layers} q{self.num_heads} kv{self.num_kv_heads} "
            f"d{self.head_dim} i{self.intermediate_size} w[{windows}] rope{self.rope_theta} eps{self.norm_eps} "
            f"seed{self.seed} {self.dtype} kv{self.cache_dtype}"
        )
        return "gdskv-reference/" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EngineConfig:
    """How the engine pages, chunks and batches.

    - ``num_slots``: page slots per layer-group pool (one int for every group, or one per group).
    - ``chunk_size``: most prompt tokens one request computes per step (chunked prefill).
    - ``tp_size``: simulated tensor parallelism; KV heads are split evenly across ranks, each rank
      with its own pools, layout and connector worker.
    - ``max_batch``: most requests admitted (running or loading) at once.
    - ``split_kv_regions``: keep K and V of a group in two tensors, so each group's layout has
      two regions (exercises multi-region connectors).
    - ``poison_last_slot``: never allocate the last slot of each pool and fill it with ``0xFF``
      bytes (NaN in every float type) — the slot a ``-1`` page index would alias. See
      ``ReferenceEngine.poison_intact``.
    - ``capture_pages``: record the bytes of every page a request holds when it completes
      (``GenerationResult.kv_pages``), for bit-for-bit comparisons in tests.
    - ``async_timeout_s``: how long the engine waits for a connector to report an asynchronous
      load or save finished before it raises.
    - ``intra_op_threads``: torch's intra-op thread count while ``generate`` runs (restored after;
      it is process-wide). The model's per-row operations are tiny, and thread hand-offs cost
      far more than they save, most of all on a loaded machine. ``None`` leaves torch alone.
    - ``freeze_heap``: collect garbage once and freeze every object alive when ``generate``
      starts (``gc.freeze``; undone after), as vLLM's engine core does after start-up: a full
      collection then walks only what the run allocated, instead of pausing a step for the
      whole start-up heap (100-160 ms here with torch and a store loaded). Off by default: it is
      process-wide and tests call ``generate`` hundreds of times; the benchmarks turn it on.
    - ``steady_heap``: keep the memory a step freed in the C heap for the next step
      (``gdskv.engine.heap``: glibc's trim and mmap thresholds raised, process-wide, for good), as
      a CPU serving process does with its allocator: otherwise every step's heap trims flush the
      TLB of the CPU the connector's threads run on and wait for it (decode steps 1.5-2x slower
      while a long prefix loaded, here). Off by default; the benchmarks turn it on.
    """

    tokens_per_block: int = 4
    num_slots: Union[int, Sequence[int]] = 64
    chunk_size: int = 16
    tp_size: int = 1
    max_batch: int = 8
    split_kv_regions: bool = False
    poison_last_slot: bool = False
    capture_pages: bool = False
    async_timeout_s: float = 30.0
    intra_op_threads: Optional[int] = 1
    freeze_heap: bool = False
    steady_heap: bool = False

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1 or self.chunk_size < 1 or self.tp_size < 1 or self.max_batch < 1:
            raise ValueError("tokens_per_block, chunk_size, tp_size and max_batch must be >= 1")

    def slots_of_group(self, layer_group_id: int, num_groups: int) -> int:
        """The page-slot count of one layer group's pool."""
        if isinstance(self.num_slots, int):
            return self.num_slots
        if len(self.num_slots) != num_groups:
            raise ValueError(f"num_slots has {len(self.num_slots)} entries for {num_groups} layer groups")
        return int(self.num_slots[layer_group_id])
