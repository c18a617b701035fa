"""The vLLM adapter's translation, without vLLM: small fakes of vLLM's config, request and
scheduler-output objects (only the fields the adapter reads). What vLLM really does with the
connector is proved by tests/test_vllm_integration.py against a real server."""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from types import SimpleNamespace as NS
from typing import Optional

import pytest
import torch

from gdskv.config import ConfigError, GdsKvConfig
from gdskv.connectors.vllm.scheduler import SchedulerSide
from gdskv.connectors.vllm.translate import ConnectorSetupError, PagePool, StepMeta, namespace_spec, store_config
from gdskv.connectors.vllm.worker import WorkerSide
from gdskv.keys import chain_keys
from gdskv.planner import Lookup, new_request, take_promised_loads
from gdskv.service import KvService

BLOCK, HEADS, HEAD = 4, 2, 8


@dataclass(frozen=True)
class FullAttentionSpec:  # the name is what the adapter checks
    block_size: int = BLOCK
    num_kv_heads: int = HEADS
    head_size: int = HEAD
    dtype: torch.dtype = torch.bfloat16
    sliding_window: Optional[int] = None
    attention_chunk_size: Optional[int] = None

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * 2


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    pass


LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def kv_cache_config(*specs, num_blocks: int = 16):
    specs = specs or (FullAttentionSpec(),)
    return NS(num_blocks=num_blocks, kv_cache_layout=None,
              kv_cache_groups=[NS(layer_names=list(LAYERS), kv_cache_spec=s) for s in specs])


def vllm_config(tp: int = 1, pp: int = 1, extra: Optional[dict] = None):
    return NS(model_config=NS(model="tiny-llama", revision=None), device_config=NS(device_type="cpu"),
              parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=1),
              kv_transfer_config=NS(kv_connector_extra_config=extra or {}))


def test_the_package_imports_without_vllm():
    import gdskv.connectors.vllm as pkg

    assert pkg.__all__ == ["GdsKvConnector"]
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError):
            pkg.GdsKvConnector  # noqa: B018 - only using the class needs vLLM


def test_namespace_spec_from_vllm_config(tmp_path):
    cfg = GdsKvConfig(store_path=str(tmp_path / "s"))
    spec = namespace_spec(vllm_config(tp=2), kv_cache_config(), cfg, tp_rank=1)
    assert (spec.model, spec.dtype, spec.tokens_per_block, spec.tp_rank, spec.tp_size) == ("tiny-llama", "bfloat16", BLOCK, 1, 2)
    assert spec.groups[0].bytes_per_page == 2 * FullAttentionSpec().page_size_bytes
    assert dict(spec.extra)["engine"] == "vllm" and dict(spec.extra)["device"] == "cpu"
    # the scheduler (rank 0 of the same config) names the same namespaces as each worker
    assert namespace_spec(vllm_config(tp=2), kv_cache_config(), cfg, 0).with_rank(1) == spec
    named = namespace_spec(vllm_config(), kv_cache_config(), GdsKvConfig(store_path=cfg.store_path, model_id="mine"), 0)
    assert named.model == "mine"


@pytest.mark.parametrize("kv, vc, match", [
    (kv_cache_config(FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)), vllm_config(), "2 KV cache groups"),
    (kv_cache_config(SlidingWindowSpec(sliding_window=8)), vllm_config(), "SlidingWindowSpec"),
    (kv_cache_config(), vllm_config(pp=2), "pipeline_parallel_size=2"),
])
def test_what_gdskv_cannot_describe_is_refused_at_bring_up(tmp_path, kv, vc, match):
    with pytest.raises(ConnectorSetupError, match=match):
        namespace_spec(vc, kv, GdsKvConfig(store_path=str(tmp_path / "s")), 0)


def test_local_attention_vllm_allocates_in_full_is_served_in_a_namespace_of_its_window(tmp_path):
    """gpt-oss / Gemma / Llama 4: without SupportsHMA vLLM promotes their sliding-window or
    chunked-local layers to one FullAttentionSpec group that records the window and keeps every
    block; the same model with the window disabled computes other KV, so it is another namespace."""
    cfg = GdsKvConfig(store_path=str(tmp_path / "s"))
    full = namespace_spec(vllm_config(), kv_cache_config(), cfg, 0)
    windowed = namespace_spec(vllm_config(), kv_cache_config(FullAttentionSpec(sliding_window=8)), cfg, 0)
    chunked = namespace_spec(vllm_config(), kv_cache_config(FullAttentionSpec(attention_chunk_size=64)), cfg, 0)
    assert dict(windowed.extra)["sliding_window"] == "8" and dict(chunked.extra)["attention_chunk_size"] == "64"
    assert "sliding_window" not in dict(full.extra) and "attention_chunk_size" not in dict(full.extra)
    assert len({full.namespace_id, windowed.namespace_id, chunked.namespace_id}) == 3
    assert windowed.groups == full.groups


def test_store_settings_come_from_gdskv_config_and_extra_config(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSKV_STORE", str(tmp_path / "env"))
    assert store_config(vllm_config()).store_path == str(tmp_path / "env")
    assert store_config(vllm_config(extra={"store_path": str(tmp_path / "x")})).store_path == str(tmp_path / "x")
    with pytest.raises(ConfigError, match="no_such_setting"):
        store_config(vllm_config(extra={"no_such_setting": 1}))


def test_page_pool_addresses_blocks_of_every_layer(tmp_path):
    page = FullAttentionSpec().page_size_bytes
    cpu = {n: torch.randn(16, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16) for n in LAYERS}  # vLLM on CPU
    pool = PagePool(cpu, LAYERS, 16, page)
    segs = pool.segments(3)
    assert len(segs) == 2 and all(s.dtype == torch.uint8 and s.numel() == page for s in segs)
    segs[1].fill_(7)
    assert torch.all(cpu[LAYERS[1]][3].view(torch.uint8) == 7) and not torch.all(cpu[LAYERS[1]][2].view(torch.uint8) == 7)
    with pytest.raises(IndexError):
        pool.segments(-1)
    split = {n: torch.zeros(2, 16, BLOCK, HEADS, HEAD, dtype=torch.bfloat16) for n in LAYERS}  # flash-attention style
    assert [s.numel() for s in PagePool(split, LAYERS, 16, page).segments(5)] == [page // 2] * 4
    hnd = {n: torch.zeros(16, BLOCK, HEADS, 2 * HEAD, dtype=torch.bfloat16).permute(0, 2, 1, 3) for n in LAYERS}
    assert [s.numel() for s in PagePool(hnd, LAYERS, 16, page).segments(5)] == [page] * 2
    with pytest.raises(ConnectorSetupError, match="page_size_bytes"):
        PagePool(cpu, LAYERS, 16, page * 2)
    with pytest.raises(ConnectorSetupError, match="no tensor for layer"):
        PagePool({LAYERS[0]: cpu[LAYERS[0]]}, LAYERS, 16, page)


def test_take_promised_loads_loads_what_the_engine_accepted():
    tokens = list(range(21))
    keys = tuple(chain_keys(tokens, BLOCK))
    state = new_request("r", tokens, None, BLOCK, 1, Lookup(keys, 1, 5, BLOCK, BLOCK))
    loads = take_promised_loads(state, [[10, 11, 12, 13, 14, 15]], 3 * BLOCK)  # vLLM took 3 of the 4 blocks offered
    assert [(op.page_slot, op.key) for op in loads[0]] == [(11, keys[1]), (12, keys[2]), (13, keys[3])]
    assert loads[0][0].parent_key == keys[0] and state.promised == (0, 0)
    assert take_promised_loads(state, [[10, 11, 12, 13, 14, 15]], 0) == {}


# --- both roles over one real store, driven with fakes of vLLM's step objects ---------------------

@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    cache_salt: Optional[str] = None
    prompt_token_ids: list[int] = field(default_factory=list)


def out(new=(), cached=None, scheduled=None, preempted=None):
    cached = cached or NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[], all_token_ids={})
    return NS(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled or {},
              preempted_req_ids=preempted)


def sides(tmp_path):
    # the disk path (host tier off): a block that vanishes from the store must fail its load; with a
    # host tier this worker would serve the pages it saved from memory (tests/test_host_tier.py)
    cfg = GdsKvConfig(store_path=str(tmp_path / "store"), host_bytes=0)
    spec = namespace_spec(vllm_config(), kv_cache_config(), cfg, 0)
    sched = SchedulerSide(KvService(cfg, spec, transfers=False))
    page = FullAttentionSpec().page_size_bytes
    worker = WorkerSide(KvService(cfg, spec), list(LAYERS), 16, page)
    caches = {n: torch.randn(16, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16) for n in LAYERS}
    worker.register(caches)
    return sched, worker, caches


def settle(worker, finished=()):
    for _ in range(200):
        sending, recving = worker.finished(set(finished))
        if sending or recving:
            return sending, recving
        time.sleep(0.01)
    return set(), set()


def test_saves_then_asynchronous_loads_then_a_failed_block(tmp_path):
    sched, worker, caches = sides(tmp_path)
    tokens = list(range(100, 118))  # 18 tokens: 4 full blocks; at most 4 served (never the last token)
    req = FakeRequest("a", tokens, prompt_token_ids=tokens)
    assert sched.matched(req, 0) == (0, False)
    sched.allocated(req, ([1, 2, 3, 4, 5],), 0)
    meta = sched.build_meta(out([NS(req_id="a", prompt_token_ids=tokens, block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)],
                                scheduled={"a": 18}))
    assert isinstance(meta, StepMeta) and not meta.loads
    assert [op.page_slot for _, ops in meta.saves for op in ops] == [1, 2, 3, 4]
    worker.start_loads(meta)
    worker.post_saves(meta)
    assert sched.finished(req) is True  # saves were planned: vLLM keeps the blocks
    meta2 = sched.build_meta(out())
    assert meta2.held == ("a",)
    worker.start_loads(meta2)
    worker.post_saves(meta2)
    assert settle(worker, ["a"]) == ({"a"}, set())
    saved = {b: [caches[n][b].clone() for n in LAYERS] for b in (1, 2, 3, 4)}

    # a new request with the same prompt: served from the store into other blocks, asynchronously
    req2 = FakeRequest("b", tokens, prompt_token_ids=tokens)
    assert sched.matched(req2, 0) == (4 * BLOCK, True)
    sched.allocated(req2, ([9, 10, 11, 12, 13],), 4 * BLOCK)
    sched.service.namespace.remove(0, chain_keys(tokens, BLOCK)[2])  # block 2 vanishes before its load
    meta3 = sched.build_meta(out())
    assert [(rid, [op.page_slot for op in ops]) for rid, ops in meta3.loads] == [("b", [9, 10, 11, 12])]
    for n in LAYERS:
        caches[n][9:13].zero_()
    worker.start_loads(meta3)
    worker.post_saves(meta3)
    assert settle(worker) == (set(), {"b"})
    assert worker.load_errors() == {11}  # vLLM recomputes from block 11
    for b, dst in ((1, 9), (2, 10), (4, 12)):
        assert all(torch.equal(caches[n][dst], saved[b][i]) for i, n in enumerate(LAYERS))
    # another salt never names the same blocks
    assert sched.matched(FakeRequest("c", tokens, cache_salt="tenant", prompt_token_ids=tokens), 0) == (0, False)
    sched.service.close()
    worker.close()


def test_a_held_request_is_reported_when_get_finished_comes_before_wait_for_save(tmp_path):
    """With speculative decoding vLLM calls ``get_finished`` before ``wait_for_save`` in a step:
    the finished id arrives before the step whose metadata holds it has posted its saves. It is
    reported once those are posted and done, never lost (vLLM passes a finished id once; a lost
    one keeps its blocks allocated for good)."""
    sched, worker, _ = sides(tmp_path)
    tokens = list(range(100, 118))
    req = FakeRequest("a", tokens, prompt_token_ids=tokens)
    assert sched.matched(req, 0) == (0, False)
    sched.allocated(req, ([1, 2, 3, 4, 5],), 0)
    meta = sched.build_meta(out([NS(req_id="a", prompt_token_ids=tokens, block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)],
                                scheduled={"a": 18}))
    worker.start_loads(meta)
    worker.post_saves(meta)
    assert sched.finished(req) is True
    meta2 = sched.build_meta(out())
    assert meta2.held == ("a",)
    worker.start_loads(meta2)
    for _ in range(50):  # the saves of step 1 land meanwhile; step 2's are not posted yet
        assert worker.finished({"a"} if _ == 0 else set()) == (set(), set())
        time.sleep(0.01)
    worker.post_saves(meta2)
    assert settle(worker) == ({"a"}, set())
    sched.service.close()
    worker.close()


def test_extra_config_path_is_an_unknown_setting_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown setting 'path'"):
        store_config(vllm_config(extra={"path": str(tmp_path / "x.toml"), "store_path": str(tmp_path / "s")}))
