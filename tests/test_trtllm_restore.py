"""End to end: the reference engine with gdskv's TensorRT-LLM connector restores KV exactly.

Run 1 computes and saves in one process; run 2, a NEW process on the same store, restores. Then:
restored page bytes equal run 1's bit for bit; run 2's logits equal bit for bit those of a
from-scratch run that splits prefill at the restored token (no connector), and are close to a
single-pass run; greedy tokens are identical. This file is also the runner the subprocesses
execute (``python tests/test_trtllm_restore.py JOBS_JSON``: a list of ``{spec, store, out}``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
from gdskv.engine.config import EngineConfig, ModelConfig
from gdskv.engine.runtime import ReferenceEngine
from gdskv.keys import chain_keys
from gdskv.planner import first_live_block
from gdskv.store import PageStore

TPB = 4


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def configs(spec: dict[str, Any], single_pass: bool = False) -> tuple[ModelConfig, EngineConfig]:
    model = ModelConfig(num_layers=3, attention_windows=tuple(spec.get("windows", ())))
    engine = EngineConfig(
        tokens_per_block=TPB, chunk_size=1000 if single_pass else spec.get("chunk", 16), tp_size=spec.get("tp", 1),
        poison_last_slot=True, capture_pages=True,
    )
    return model, engine


def run_engine(spec: dict[str, Any], store: Optional[str], split_at: Any = None, single_pass: bool = False) -> dict[str, Any]:
    """Generate ``spec["prompts"]`` with (``store`` given) or without the gdskv connector."""
    model_cfg, engine_cfg = configs(spec, single_pass)
    scheduler = workers = None
    if store is not None:
        os.environ["GDSKV_STORE"] = store
        tp = engine_cfg.tp_size
        scheduler = GdsKvScheduler(StandaloneLlmArgs.build(model_cfg.fingerprint(), TPB, 0, tp))
        workers = [GdsKvWorker(StandaloneLlmArgs.build(model_cfg.fingerprint(), TPB, r, tp)) for r in range(tp)]
    engine = ReferenceEngine(model_cfg, engine_cfg, scheduler, workers)
    t0 = time.perf_counter()
    results = engine.generate(spec["prompts"], spec.get("max_new", 4), spec.get("salts"), split_at)
    wall = time.perf_counter() - t0
    out = {
        "results": [
            {"tokens": r.tokens, "logits": torch.stack(r.logits), "loaded": r.prefill_tokens_loaded,
             "ttft_s": r.ttft_s, "kv_pages": r.kv_pages}
            for r in results
        ],
        "poison_intact": engine.poison_intact(),
        "wall_s": wall,
    }
    if store is not None:
        out["scheduler"] = vars(scheduler.counters)
        out["workers"] = [vars(w.counters) for w in workers]
        for w in workers:
            w.close()
    return out


def in_new_process(jobs: list[tuple[dict[str, Any], str]], out_dir: Path, name: str) -> list[dict[str, Any]]:
    """``run_engine`` with the connector for each ``(spec, store)`` job, one after the other, in
    one fresh Python process: only the stores carry over from earlier runs."""
    plan = [{"spec": spec, "store": store, "out": str(out_dir / f"{name}-{i}.pt")} for i, (spec, store) in enumerate(jobs)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, __file__, json.dumps(plan)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(job["out"], weights_only=False) for job in plan]


def run_once(spec: dict[str, Any], store: str, out_dir: Path, name: str) -> dict[str, Any]:
    return in_new_process([(spec, store)], out_dir, name)[0]


def check_restored(spec: dict[str, Any], run1: dict[str, Any], run2: dict[str, Any], loaded: list[int]) -> None:
    """Run 2 against run 1 and against from-scratch runs of the same prompts."""
    assert [r["loaded"] for r in run2["results"]] == loaded
    assert run1["poison_intact"] and run2["poison_intact"]
    split = [n or None for n in loaded]
    split_ref = run_engine(spec, None, split_at=split)
    single = run_engine(spec, None, single_pass=True)
    for i, (r1, r2) in enumerate(zip(run1["results"], run2["results"])):
        # the restored pages are the pages run 1 computed (those both runs still hold at the end)
        compared = 0
        for (rank, g, o), data in r2["kv_pages"].items():
            if o < r2["loaded"] // TPB and (rank, g, o) in r1["kv_pages"]:
                assert data == r1["kv_pages"][(rank, g, o)], (i, rank, g, o)
                compared += 1
        assert compared or not r2["loaded"]
        assert torch.equal(r2["logits"], split_ref["results"][i]["logits"]), f"request {i}: logits differ from a run split at {loaded[i]}"
        torch.testing.assert_close(r2["logits"], single["results"][i]["logits"], rtol=1e-4, atol=1e-4)
        assert r2["tokens"] == single["results"][i]["tokens"] == r1["tokens"]
        assert not torch.isnan(r2["logits"]).any()


def namespaces(store: str) -> list:
    return PageStore.open(store, create=False).namespaces()


P39 = prompt(39, 1)  # 9 full blocks and 3 tokens; 9 servable (36 tokens)
SHARED = prompt(20, 2)

# name: (spec of both runs, tokens run 2 restores per prompt)
SCENARIOS: dict[str, tuple[dict[str, Any], list[int]]] = {
    "full-attention": ({"windows": [], "chunk": 16, "prompts": [P39]}, [36]),
    "uniform-sliding-window": ({"windows": [24], "chunk": 8, "prompts": [P39]}, [36]),
    "vswa-two-windows-and-full": ({"windows": [8, 16, None], "chunk": 4, "prompts": [P39]}, [36]),
    "chunked-prefill": ({"windows": [], "chunk": 6, "prompts": [P39]}, [36]),
    "tp2": ({"windows": [], "chunk": 16, "tp": 2, "prompts": [P39]}, [36]),
    "two-requests-sharing-a-prefix": ({"windows": [], "chunk": 8, "prompts": [SHARED + prompt(11, 3), SHARED + prompt(11, 4)]}, [28, 28]),
}


@pytest.fixture(scope="module")
def restored(tmp_path_factory) -> dict[str, tuple[str, dict[str, Any], dict[str, Any]]]:
    """Every scenario's run 1 in one new process, then every run 2 in another (one store each)."""
    root = tmp_path_factory.mktemp("restore")
    jobs = [(spec, str(root / name)) for name, (spec, _) in SCENARIOS.items()]
    run1 = in_new_process(jobs, root, "run1")
    run2 = in_new_process(jobs, root, "run2")
    return {name: (store, r1, r2) for (name, (_, store)), r1, r2 in zip(zip(SCENARIOS, jobs), run1, run2)}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_restores_exactly_in_a_new_process(name, restored):
    spec, loaded = SCENARIOS[name]
    store, run1, run2 = restored[name]
    assert [r["loaded"] for r in run1["results"]] == [0] * len(loaded)
    check_restored(spec, run1, run2, loaded)
    assert all(w["loads_failed"] == 0 for w in run2["workers"])
    if name == "chunked-prefill":
        (ns,) = namespaces(store)
        keys = chain_keys(P39, TPB)
        assert len(keys) == 9 and all(ns.contains_many(0, keys)), "every full block of the prompt"
    if name == "tp2":
        nss = namespaces(store)
        assert sorted(ns.spec.tp_rank for ns in nss) == [0, 1]
        assert all(all(ns.contains_many(0, chain_keys(P39, TPB))) for ns in nss)
    if name == "two-requests-sharing-a-prefix":
        (ns,) = namespaces(store)
        all_keys = {k for p in spec["prompts"] for k in chain_keys(p, TPB)}
        assert len(all_keys) == 5 + 2 * 2 and all(ns.contains_many(0, sorted(all_keys))), "shared blocks stored once"


def test_a_salted_request_does_not_hit_another_salts_blocks(store_path, tmp_path):
    spec1 = {"windows": [], "chunk": 16, "prompts": [P39], "salts": ["tenant-a"]}
    run1 = run_once(spec1, store_path, tmp_path, "run1")
    spec2 = {"windows": [], "chunk": 16, "prompts": [P39, P39, P39], "salts": ["tenant-b", None, "tenant-a"]}
    run2 = run_once(spec2, store_path, tmp_path, "run2")
    assert [r["loaded"] for r in run2["results"]] == [0, 0, 36]
    ref = run_engine(spec2, None, split_at=[None, None, 36])
    for r, rr in zip(run2["results"], ref["results"]):
        assert torch.equal(r["logits"], rr["logits"])
    assert run2["results"][2]["tokens"] == run1["results"][0]["tokens"]


def test_sliding_window_stores_only_the_live_window_and_serves_within_the_smallest(store_path, tmp_path):
    windows = [12, 20, None]  # VSWA: two sliding groups and a full-attention group
    # single-pass prefill of 39 tokens and one generated token: the only step ends at token 39
    spec = {"windows": windows, "chunk": 64, "prompts": [P39], "max_new": 1}
    run_once(spec, store_path, tmp_path, "long")
    (ns,) = namespaces(store_path)
    keys = chain_keys(P39, TPB)
    stored = [[o for o, there in enumerate(ns.contains_many(g, keys)) if there] for g in range(3)]
    assert stored[0] == list(range(first_live_block(39, 12, TPB), 9)) == [7, 8], "only window 12's live blocks"
    assert stored[1] == list(range(first_live_block(39, 20, TPB), 9)) == [5, 6, 7, 8], "only window 20's live blocks"
    assert stored[2] == list(range(9)), "the full-attention group holds every block"
    # nothing is served: block 0 is missing in the sliding groups; then a prompt short enough for
    # the smallest window is stored whole, and a longer one sharing it is served that much
    short = {"windows": windows, "chunk": 64, "prompts": [P39[:11]], "max_new": 1}
    again, _ = in_new_process([(spec, store_path), (short, store_path)], tmp_path, "again")
    assert again["results"][0]["loaded"] == 0
    run = run_once(spec, store_path, tmp_path, "served")
    assert run["results"][0]["loaded"] == 8 <= min(w for w in windows if w)
    ref = run_engine(spec, None, split_at=8)
    assert torch.equal(run["results"][0]["logits"], ref["results"][0]["logits"])


def test_a_corrupt_chunk_is_recomputed_never_served_and_saved_again(store_path, tmp_path):
    spec = {"windows": [], "chunk": 16, "prompts": [P39]}
    run1 = run_once(spec, store_path, tmp_path, "run1")
    (ns,) = namespaces(store_path)
    path = ns.chunk_path(0, chain_keys(P39, TPB)[2])
    raw = bytearray(Path(path).read_bytes())
    raw[100] ^= 0x01  # one bit of the payload
    Path(path).write_bytes(bytes(raw))
    run2 = run_once(spec, store_path, tmp_path, "run2")
    assert run2["results"][0]["loaded"] == 0, "the load failed, the engine recomputed"
    assert run2["workers"][0]["loads_failed"] == 1
    assert torch.equal(run2["results"][0]["logits"], run1["results"][0]["logits"])
    assert ns.contains(0, chain_keys(P39, TPB)[2]), "recomputed and saved again"
    run3 = run_once(spec, store_path, tmp_path, "run3")
    check_restored(spec, run1, run3, [36])


if __name__ == "__main__":
    torch.set_num_threads(1)
    for job in json.loads(sys.argv[1]):
        torch.save(run_engine(job["spec"], job["store"]), job["out"])
