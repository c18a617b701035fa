"""Request types of the reference engine: what it tracks, and what it tells a connector.

``RequestData`` and ``SchedulerOutput`` mirror the TensorRT-LLM types a connector's
``build_connector_meta`` receives (field names as in the spec); the scheduler loop builds one
``SchedulerOutput`` per step. ``EngineRequest`` is the engine's own request record and doubles as
the ``LlmRequest`` a connector's scheduler callbacks receive: it exposes ``request_id``,
``get_tokens(beam)`` and ``cache_salt``. ``GenerationResult`` is what ``ReferenceEngine.generate``
returns per prompt.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class RequestData:
    """One request's entry in a ``SchedulerOutput``; token and block lists are deltas.

    ``new_tokens`` / ``new_block_ids*`` hold what was appended since the request was last
    reported (everything, on its first report). Block entries are page slots per block ordinal,
    ``-1`` where the block has no page; ``new_block_ids`` is the flat form, empty when the cache
    has more than one layer group. ``computed_position`` counts tokens already computed or
    loaded before this step, less (on the first report, as TensorRT-LLM does) the tokens the
    connector offered for a synchronous load; ``num_scheduled_tokens`` is what this step's
    forward pass computes.
    """

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    new_block_ids_by_layer_group: list[list[int]]
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    priorities: Optional[list[int]] = None
    cache_salt: Optional[str] = None


@dataclass
class SchedulerOutput:
    """What one step schedules: first reports in ``new_requests``, later deltas in ``cached_requests``."""

    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


class RequestState(enum.Enum):
    WAITING = "waiting"        # not admitted yet: no pages, connector not asked
    LOADING = "loading"        # pages held, asynchronous load in flight, not in the forward pass
    RUNNING = "running"        # prefill chunks or generation steps
    SAVING = "saving"          # complete; pages held until the connector reports the save done
    DONE = "done"


@dataclass
class EngineRequest:
    """The engine's record of one request (and the ``LlmRequest`` handed to connector callbacks)."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    cache_salt: Optional[str]
    split_prefill_at: Optional[int]
    arrival_s: float
    num_groups: int
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    block_ids: list[list[int]] = field(default_factory=list)
    """Per layer group, the page slot of every block ordinal allocated so far (-1 once reclaimed)."""
    num_computed: int = 0
    """Tokens whose KV is in the pages (computed or loaded)."""
    num_loaded: int = 0
    """Prompt tokens the connector was honoured for (0 after a load failure)."""
    offered_sync: int = 0
    """Tokens the connector offered for a synchronous load: left out of the first report's
    ``computed_position``, as TensorRT-LLM leaves out the connector's matched tokens."""
    prefix_verified: bool = True
    """False from admission with a loaded prefix until the end of its first computing step."""
    ttft_s: float = 0.0
    """Seconds from ``generate`` being called to this request's first token."""
    kv_pages: Optional[dict[tuple[int, int, int], bytes]] = None
    _reported: bool = False
    _reported_tokens: int = 0
    _reported_blocks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_ids = [[] for _ in range(self.num_groups)]
        self._reported_blocks = [0] * self.num_groups

    # -- the LlmRequest surface connectors use ----------------------------------------------

    def get_tokens(self, beam: int = 0) -> list[int]:
        """Prompt and generated tokens so far (beam 0 is the only beam)."""
        if beam != 0:
            raise ValueError("the reference engine decodes greedily: beam 0 only")
        return self.prompt + self.generated

    # -- called by the scheduler loop -------------------------------------------------------

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def is_complete(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    def next_chunk(self, chunk_size: int) -> tuple[int, int]:
        """Token positions ``[start, end)`` this request computes in its next step."""
        start = self.num_computed
        if start >= self.prompt_len:
            return start, start + 1
        end = min(start + chunk_size, self.prompt_len)
        if self.split_prefill_at is not None and start < self.split_prefill_at:
            end = min(end, self.split_prefill_at)
        return start, end

    def report(self, num_scheduled_tokens: int) -> tuple[bool, RequestData]:
        """This step's ``RequestData`` (deltas since the last report) and whether it is the first."""
        tokens = self.get_tokens(0)
        by_group = [ids[self._reported_blocks[g]:] for g, ids in enumerate(self.block_ids)]
        data = RequestData(
            request_id=self.request_id,
            new_tokens=tokens[self._reported_tokens:],
            new_block_ids=list(by_group[0]) if self.num_groups == 1 else [],
            new_block_ids_by_layer_group=by_group,
            computed_position=self.num_computed - (self.offered_sync if not self._reported else 0),
            num_scheduled_tokens=num_scheduled_tokens,
            cache_salt=self.cache_salt,
        )
        is_new = not self._reported
        self._reported, self._reported_tokens = True, len(tokens)
        self._reported_blocks = [len(ids) for ids in self.block_ids]
        return is_new, data


@dataclass
class GenerationResult:
    """One prompt's outcome from ``ReferenceEngine.generate``.

    ``logits[i]`` is the float32 distribution ``tokens[i]`` was sampled (greedily) from;
    ``prefill_tokens_loaded`` counts prompt tokens whose KV came from the connector (and stayed,
    i.e. was not discarded after a reported load failure); ``kv_pages`` maps
    ``(tp_rank, layer_group_id, block_ordinal)`` to page bytes at completion when
    ``EngineConfig.capture_pages`` is set.
    """

    request_id: int
    prompt: list[int]
    tokens: list[int]
    logits: list[torch.Tensor]
    prefill_tokens_loaded: int
    ttft_s: float
    kv_pages: Optional[dict[tuple[int, int, int], bytes]] = None

    @property
    def first_logits(self) -> torch.Tensor:
        """The logits at the end of prefill."""
        return self.logits[0]
