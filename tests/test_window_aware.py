"""Window-aware serving (``window_aware = true``) on the reference engine with gdskv's TensorRT-LLM
connector, across processes.

A VSWA model (two sliding groups and a full-attention group), a non-chunked prompt several windows
long. Run 1 computes and saves in one process; run 2, a new process on the same store with the
option on, serves past the smallest window: logits bit-identical to a from-scratch run split at
the served length, tokens identical to a single-pass run; only the sliding pages inside each window
are loaded, and a sliding group's stored chunks are bounded by its window. With the option off the
smallest-window rule holds (nothing served: block 0 is missing in the sliding groups).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_trtllm_restore import TPB, prompt, run_engine  # noqa: E402

from gdskv.keys import chain_keys  # noqa: E402
from gdskv.planner import first_live_block, window_blocks, window_keep_from  # noqa: E402
from gdskv.store import PageStore  # noqa: E402

WINDOWS = [8, 14, None]  # 14 is not a multiple of the block size (4)
PROMPT = prompt(39, 11)  # 9 full blocks + 3 tokens: 36 servable tokens, more than 4 windows of 8
MAX_NEW = 4  # the decode feeds tokens up to 42: block 9 completes too
SPEC = {"windows": WINDOWS, "chunk": 64, "prompts": [PROMPT], "max_new": MAX_NEW}
CHUNKED = dict(SPEC, chunk=4)


def in_new_process(jobs: list[tuple[dict[str, Any], str]], window_aware: bool, out_dir: Path, name: str) -> list[dict[str, Any]]:
    """``run_engine`` with the connector for each job in one fresh process, with the option set."""
    cfg = out_dir / f"{name}.toml"
    cfg.write_text(f"[gdskv]\nwindow_aware = {'true' if window_aware else 'false'}\n")
    plan = [{"spec": spec, "store": store, "out": str(out_dir / f"{name}-{i}.pt")} for i, (spec, store) in enumerate(jobs)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GDSKV_CONFIG=str(cfg), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    runner = Path(__file__).resolve().parent / "test_trtllm_restore.py"
    proc = subprocess.run([sys.executable, str(runner), json.dumps(plan)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(job["out"], weights_only=False) for job in plan]


def stored_blocks(store: str) -> list[list[int]]:
    """Per layer group: the block ordinals of PROMPT + generated tokens the store holds."""
    (ns,) = PageStore.open(store, create=False).namespaces()
    keys = chain_keys(PROMPT + [0] * 8, TPB)[:10]  # ordinals 0..8 are the prompt's; 9 holds generated tokens
    return [[o for o, there in enumerate(ns.contains_many(g, keys[:9])) if there] for g in range(len(WINDOWS))]


def chunk_files(store: str) -> dict[int, int]:
    """Chunk files on disk per layer group."""
    s = PageStore.open(store, create=False)
    counts: dict[int, int] = {}
    for _, group, entry in s.iter_chunk_files():
        if entry.is_chunk:
            counts[group] = counts.get(group, 0) + 1
    return counts


def test_window_aware_serves_past_the_smallest_window_exactly(tmp_path):
    on, off, chunked, off_chunked = (str(tmp_path / n) for n in ("on", "off", "chunked", "off-chunked"))
    run1_on = in_new_process([(SPEC, on), (CHUNKED, chunked)], True, tmp_path, "run1-on")
    run1_off = in_new_process([(SPEC, off), (CHUNKED, off_chunked)], False, tmp_path, "run1-off")
    assert all(r["results"][0]["loaded"] == 0 for r in run1_on + run1_off)

    # what run 1 stored: with the option on, a sliding group keeps only blocks from window_keep_from
    limit = (len(PROMPT) - 1) // TPB  # 9 blocks, 36 tokens
    for store in (on, chunked):
        blocks = stored_blocks(store)
        files = chunk_files(store)
        for g, w in enumerate(WINDOWS):
            if w is None:
                assert blocks[g] == list(range(9)) and files[g] == 10  # + block 9 (generated tokens)
                continue
            keep = window_keep_from(len(PROMPT), w, TPB)
            assert keep == window_blocks(limit, w, TPB).start == (36 - w) // TPB
            assert blocks[g] == list(range(keep, 9)), (store, g, blocks[g])
            assert files[g] == 9 - keep + 1 <= -(-w // TPB) + 2, "sliding bytes bounded by the window"
    # the default keeps only live blocks in a single pass, and every block under small chunks
    blocks_off = stored_blocks(off)
    for g, w in enumerate(WINDOWS):
        assert blocks_off[g] == list(range(first_live_block(len(PROMPT), w, TPB), 9))
    assert chunk_files(off_chunked)[0] == 10, "option off, chunks of 4: every block of window 8 saved while live"
    assert chunk_files(chunked)[0] == 9 - window_keep_from(len(PROMPT), 8, TPB) + 1

    # run 2, new processes: option on serves 36 tokens (past both windows), option off serves none
    run2_on, run2_chunked = in_new_process([(SPEC, on), (SPEC, chunked)], True, tmp_path, "run2-on")
    (run2_off,) = in_new_process([(SPEC, on)], False, tmp_path, "run2-off")
    assert run2_off["results"][0]["loaded"] == 0, "smallest-window rule: block 0 is missing in the sliding groups"
    served = limit * TPB
    assert served > max(w for w in WINDOWS if w)
    split_ref = run_engine(SPEC, None, split_at=served)
    single = run_engine(SPEC, None, single_pass=True)
    for run2 in (run2_on, run2_chunked):
        (r,) = run2["results"]
        assert r["loaded"] == served
        assert run2["poison_intact"]
        assert torch.equal(r["logits"], split_ref["results"][0]["logits"])
        torch.testing.assert_close(r["logits"], single["results"][0]["logits"], rtol=1e-4, atol=1e-4)
        assert r["tokens"] == single["results"][0]["tokens"] == run1_on[0]["results"][0]["tokens"]
        assert not torch.isnan(r["logits"]).any()
        (w,) = run2["workers"]
        # only the pages each group needs: every block for full attention, the window tail otherwise
        expected = sum(len(window_blocks(limit, win, TPB)) for win in WINDOWS)
        assert w["loads_loaded"] == expected == 9 + 2 + 4 and w["loads_failed"] == 0
    # the restored pages (those run 2 still holds at the end, below the served length) are run 1's
    compared = 0
    for (rank, g, o), data in run2_on["results"][0]["kv_pages"].items():
        if o < limit and (rank, g, o) in run1_on[0]["results"][0]["kv_pages"]:
            assert data == run1_on[0]["results"][0]["kv_pages"][(rank, g, o)]
            compared += 1
    assert compared
