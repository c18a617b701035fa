"""What makes KV incompatible: a namespace's spec and its layer groups' page geometry.

A ``NamespaceSpec`` hashes to its namespace's directory name (``namespace_id``); connectors
build one from the engine's layout at bring-up (``from_layout``), ``PageStore.namespaces`` reads
one back from every namespace's metadata (``from_json``, every value checked).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Optional

from gdskv import format as fmt

MAX_PAGE_BYTES = (1 << 32) - 1
_MAX_INT = (1 << 31) - 1


@dataclass(frozen=True)
class GroupSpec:
    """Page geometry of one layer group, as far as it decides KV compatibility."""

    layer_group_id: int
    bytes_per_page: int
    layer_ids: tuple[int, ...]
    window_size: Optional[int] = None


@dataclass(frozen=True)
class NamespaceSpec:
    """Everything that makes KV incompatible. Equal specs share a namespace; any difference
    (model, dtype, page geometry, TP shard, format version) is another namespace, never a wrong load."""

    model: str
    dtype: str
    tokens_per_block: int
    groups: tuple[GroupSpec, ...]
    tp_rank: int = 0
    tp_size: int = 1
    extra: tuple[tuple[str, str], ...] = ()
    format_version: int = fmt.FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = [asdict(g) | {"layer_ids": list(g.layer_ids)} for g in self.groups]
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Any) -> "NamespaceSpec":
        """The spec a namespace's metadata describes. Every value is checked before use (types,
        ranges, unique layer groups): ``ValueError`` says which one is bad. Called by
        ``PageStore.namespaces`` on every namespace found on disk."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"namespace metadata: {what}")

        def count(v: Any, lo: int, hi: int = _MAX_INT) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        need(isinstance(d, dict), "not an object")
        need(isinstance(d.get("model"), str) and isinstance(d.get("dtype"), str), "model and dtype must be strings")
        need(count(d.get("tokens_per_block"), 1), "tokens_per_block must be a positive integer")
        raw = d.get("groups")
        need(isinstance(raw, list) and len(raw) > 0, "groups must be a non-empty list")
        groups = []
        for g in raw:
            need(isinstance(g, dict), "a group is not an object")
            need(count(g.get("layer_group_id"), 0), "layer_group_id must be a non-negative integer")
            need(count(g.get("bytes_per_page"), 1, MAX_PAGE_BYTES), "bytes_per_page must be a positive integer below 4 GiB")
            ids = g.get("layer_ids")
            need(isinstance(ids, list) and all(count(i, 0) for i in ids), "layer_ids must be a list of non-negative integers")
            w = g.get("window_size")
            need(w is None or count(w, 1), "window_size must be null or a positive integer")
            groups.append(GroupSpec(g["layer_group_id"], g["bytes_per_page"], tuple(ids), w))
        need(len({g.layer_group_id for g in groups}) == len(groups), "layer_group_id values must be unique")
        tp_rank, tp_size = d.get("tp_rank", 0), d.get("tp_size", 1)
        need(count(tp_size, 1) and count(tp_rank, 0, tp_size - 1 if count(tp_size, 1) else 0), "tp_rank/tp_size out of range")
        extra = d.get("extra", {})
        need(isinstance(extra, dict), "extra must be an object")
        version = d.get("format_version", fmt.FORMAT_VERSION)
        need(count(version, 0), "format_version must be an integer")
        return cls(
            model=d["model"], dtype=d["dtype"], tokens_per_block=d["tokens_per_block"], groups=tuple(groups),
            tp_rank=tp_rank, tp_size=tp_size, extra=tuple(sorted((str(k), str(v)) for k, v in extra.items())),
            format_version=version,
        )

    @property
    def namespace_id(self) -> str:
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def group(self, layer_group_id: int) -> GroupSpec:
        for g in self.groups:
            if g.layer_group_id == layer_group_id:
                return g
        raise KeyError(f"namespace has no layer group {layer_group_id}")

    def with_rank(self, tp_rank: int) -> "NamespaceSpec":
        return NamespaceSpec(self.model, self.dtype, self.tokens_per_block, self.groups, tp_rank, self.tp_size, self.extra, self.format_version)

    @classmethod
    def from_layout(cls, layout: Any, model: str, tp_rank: int = 0, tp_size: int = 1, extra: Optional[dict[str, Any]] = None) -> "NamespaceSpec":
        """Derive the spec from a ``KvCacheLayout`` (ours or TensorRT-LLM's, duck-typed)."""
        groups = tuple(
            GroupSpec(int(g.layer_group_id), int(g.bytes_per_page), tuple(int(i) for i in g.layer_ids),
                      None if g.window_size is None else int(g.window_size))
            for g in layout.groups
        )
        return cls(
            model=model, dtype=str(layout.dtype).removeprefix("torch."), tokens_per_block=int(layout.tokens_per_block),
            groups=groups, tp_rank=tp_rank, tp_size=tp_size,
            extra=tuple(sorted((str(k), str(v)) for k, v in (extra or {}).items())),
        )
