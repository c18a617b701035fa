"""A tiny decoder-only transformer (RMSNorm, RoPE, GQA attention, SwiGLU MLP) with seeded weights.

Called by the scheduler loop (``gdskv.engine.runtime``) one layer at a time, so the connector's
per-layer hooks can run between layers. The model never touches pages: it writes and reads KV
through the ``KvAccess`` the loop hands it, which maps token positions onto page slots.

Shape stability is the design rule here. Every operation runs on one token row at a time, on
freshly allocated operands whose shapes depend only on that token's position and window, never
on how many rows a chunk holds or where a row sits in it. So a token's KV and logits are
bit-identical however prefill was chunked, and KV loaded from a store is indistinguishable from
KV computed locally. Attention is computed per KV head on every layout; a tensor-parallel rank
owns a subset of those heads, so TP=2 gives the same bits as TP=1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from gdskv.engine.config import ModelConfig


class KvAccess(Protocol):
    """What the model needs from the paged KV cache for one request during one step."""

    def write(self, layer: int, positions: Sequence[int], k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> None:
        """Store K and V (each ``[num_kv_heads, head_dim]``) of ``layer`` at token ``positions``."""

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for positions ``[0, end)`` as ``[num_kv_heads, end, head_dim]``.

        Positions whose page was reclaimed read as NaN; the model never attends to them.
        """


@dataclass
class _LayerWeights:
    attn_norm: torch.Tensor
    qkv: list[torch.Tensor]
    """Per KV head: ``[hidden, (q_per_kv + 2) * head_dim]`` — its query heads, then K, then V."""
    o_proj: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class ReferenceModel:
    """The weights and per-row math of the reference engine's model."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        h, d, q_per_kv = cfg.hidden_size, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads

        def rand(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(cfg.dtype)

        def norm_weight() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(h, generator=gen)).to(cfg.dtype)

        self.embed_tokens = rand(cfg.vocab_size, h, scale=1.0)
        self.layers = [
            _LayerWeights(
                attn_norm=norm_weight(),
                qkv=[rand(h, (q_per_kv + 2) * d, scale=1 / math.sqrt(h)) for _ in range(cfg.num_kv_heads)],
                o_proj=rand(cfg.num_heads * d, h, scale=1 / math.sqrt(cfg.num_heads * d)),
                mlp_norm=norm_weight(),
                gate_up=rand(h, 2 * cfg.intermediate_size, scale=1 / math.sqrt(h)),
                down=rand(cfg.intermediate_size, h, scale=1 / math.sqrt(cfg.intermediate_size)),
            )
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = norm_weight()
        self.lm_head = rand(h, cfg.vocab_size, scale=1 / math.sqrt(h))
        self._inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self._rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- called by the scheduler loop -------------------------------------------------------

    def embed(self, tokens: Sequence[int]) -> list[torch.Tensor]:
        """One ``[1, hidden]`` row per token, the residual stream entering layer 0."""
        return [self.embed_tokens[int(t)].clone().reshape(1, -1) for t in tokens]

    @torch.no_grad()
    def layer_forward(self, layer: int, rows: Sequence[torch.Tensor], positions: Sequence[int], kv: KvAccess) -> list[torch.Tensor]:
        """Run ``layer`` on a request's chunk: ``rows[i]`` is the token at ``positions[i]``.

        Writes the chunk's K/V through ``kv`` first, then reads every position up to the chunk's
        end back from it, so attention always sees the pool's bytes (loaded or computed alike).
        """
        cfg, w = self.cfg, self.layers[layer]
        q_per_kv, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        queries: list[list[torch.Tensor]] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for row, pos in zip(rows, positions):
            x = self._rms_norm(row, w.attn_norm)
            q_heads, k_heads, v_heads = [], [], []
            for kv_head in range(cfg.num_kv_heads):
                qkv = x @ w.qkv[kv_head]
                q_heads.append(self._rope(qkv[0, : q_per_kv * d].reshape(q_per_kv, d), pos))
                k_heads.append(self._rope(qkv[0, q_per_kv * d:(q_per_kv + 1) * d].reshape(1, d), pos)[0])
                v_heads.append(qkv[0, (q_per_kv + 1) * d:].clone())
            queries.append(q_heads)
            keys.append(torch.stack(k_heads))
            values.append(torch.stack(v_heads))
        kv.write(layer, positions, keys, values)
        k_all, v_all = kv.read(layer, positions[-1] + 1)

        window = cfg.window_of_layer(layer)
        out = []
        for row, pos, q_heads in zip(rows, positions, queries):
            lo = 0 if window is None else max(0, pos - window + 1)
            heads = [self._attend(q, k_all[g, lo:pos + 1].clone(), v_all[g, lo:pos + 1].clone()) for g, q in enumerate(q_heads)]
            h = row + torch.cat(heads).reshape(1, -1) @ w.o_proj
            gate, up = (self._rms_norm(h, w.mlp_norm) @ w.gate_up).chunk(2, dim=-1)
            out.append(h + (torch.nn.functional.silu(gate) * up) @ w.down)
        return out

    @torch.no_grad()
    def logits(self, row: torch.Tensor) -> torch.Tensor:
        """The ``[vocab_size]`` float32 logits of the last layer's output row."""
        return (self._rms_norm(row, self.final_norm) @ self.lm_head)[0].float()

    # -- per-row math -----------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return normed.to(self.cfg.dtype) * weight

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Rotate-half RoPE of ``x`` (``[heads, head_dim]``) at token position ``pos``."""
        if pos not in self._rope_cache:
            angles = pos * self._inv_freq
            self._rope_cache[pos] = (angles.cos().to(self.cfg.dtype), angles.sin().to(self.cfg.dtype))
        cos, sin = self._rope_cache[pos]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Softmax attention of one KV head's query heads ``[q_per_kv, d]`` over ``[n, d]`` keys."""
        scores = (q @ k.T).float() / math.sqrt(self.cfg.head_dim)
        return (torch.softmax(scores, dim=-1).to(self.cfg.dtype) @ v).reshape(-1)
