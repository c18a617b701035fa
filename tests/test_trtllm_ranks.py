"""TensorRT-LLM ranks in separate processes (as MPI runs them) on one store: a load that fails on
one rank stops every rank from saving what that request computes afterwards.

Rank 0 (with the scheduler) runs in the test process; rank 1's worker runs in a child process
that executes the worker calls the test's runtime sends it, with the step's metadata pickled as
TensorRT-LLM's broadcast does.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker
from gdskv.keys import chain_keys
from gdskv.layout import single_pool_layout
from gdskv.store import PageStore
from gdskv.store.taints import STALE_SECONDS, TAINT_DIR, TaintBoard
from tests.test_trtllm_connector import PROMPT, TPB, FakeRequest, Runtime, args, single_pool, store  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
from gdskv.connectors.trtllm import GdsKvWorker
from gdskv.layout import single_pool_layout
from tests.test_trtllm_connector import TPB, args, single_pool
rank, tp, seed = map(int, sys.argv[2:5])
worker = GdsKvWorker(args(rank, tp))
worker.register_kv_cache_layout(single_pool_layout(single_pool(seed=seed), TPB))
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    name, call_args = pickle.load(inp)
    result = worker.counters if name == "counters" else getattr(worker, name)(*call_args)
    pickle.dump(result, out)
    out.flush()
    if name == "close":
        break
"""


class RankInChild:
    """A ``GdsKvWorker`` of another rank in a process of its own: each call is sent to it and
    answered before the next one, as the ranks' hooks run in step."""

    def __init__(self, rank: int, tp: int, seed: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT), str(rank), str(tp), str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ))

    def _call(self, name: str, *call_args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        pickle.dump((name, call_args), self.proc.stdin)
        self.proc.stdin.flush()
        return pickle.load(self.proc.stdout)

    def __getattr__(self, name: str) -> Any:
        if name == "counters":
            return self._call("counters")
        return lambda *call_args: self._call(name, *call_args)

    def close(self) -> None:
        self._call("close")
        self.proc.wait(timeout=30)


def two_processes(seed: int) -> Runtime:
    """Rank 0's worker and the scheduler here, rank 1's worker in a child process."""
    local = GdsKvWorker(args(0, 2))
    local.register_kv_cache_layout(single_pool_layout(single_pool(seed=seed), TPB))
    return Runtime(GdsKvScheduler(args(0, 2)), [local, RankInChild(1, 2, seed + 1)], 2)


@pytest.mark.parametrize("bad_rank", [0, 1], ids=["failed-here", "failed-in-the-other-process"])
def test_a_load_that_fails_on_one_rank_stops_the_saves_of_ranks_in_other_processes(store, bad_rank):
    rt = two_processes(seed=9)
    req = FakeRequest(1, PROMPT[:13])  # 3 full blocks, saved by both ranks
    rt.admit(req, [[0, 1, 2, 3]])
    rt.step([(req, [[0, 1, 2, 3]], 0, 13)])
    assert rt.finish(req, [[0, 1, 2, 3]])
    spec = rt.workers[0].namespace.spec
    rt.close()
    shards = [PageStore.open(store).namespace(spec.with_rank(r)) for r in (0, 1)]
    keys = chain_keys(PROMPT, TPB)
    bad = shards[bad_rank].chunk_path(0, keys[1])
    raw = bytearray(open(bad, "rb").read())
    raw[5] ^= 0xFF
    open(bad, "wb").write(bytes(raw))

    rt2 = two_processes(seed=20)
    req2 = FakeRequest(2, PROMPT)
    pages2 = [[0, 1, 2, 3, 4, 5]]
    assert rt2.admit(req2, pages2) == 12
    meta = rt2.step([(req2, pages2, 12, 11)])  # rank `bad_rank`'s load fails; blocks 3 and 4 complete
    assert len(meta.saves_of_group(0)) == 2
    # neither rank saves its shard of KV computed on top of the other's failed load
    assert [w.counters.saves_suppressed for w in rt2.workers] == [2, 2]
    assert [ns.contains_many(0, keys[3:5]) for ns in shards] == [[False, False]] * 2
    assert rt2.finish(req2, pages2)
    assert not list((Path(store) / TAINT_DIR).iterdir()), "the marker goes once every rank settled the request"
    rt2.close()


def test_markers_a_crashed_engine_left_are_swept_once_a_day_old(tmp_path):
    store = PageStore.open(tmp_path / "store")
    board = TaintBoard(store.fs)
    board.mark("0123456789abcdef", 7)
    board.mark("0123456789abcdef", 8)
    board.mark("../../escape", 9)  # not a deployment id: no file anywhere
    old = tmp_path / "store" / TAINT_DIR / "0123456789abcdef.7"
    os.utime(old, (time.time() - STALE_SECONDS - 60,) * 2)
    assert board.marked("0123456789abcdef") == {7, 8}
    assert board.sweep() == 1
    assert board.marked("0123456789abcdef") == {8} and board.marked("fedcba9876543210") == set()
    assert sorted(p.name for p in (tmp_path / "store" / TAINT_DIR).iterdir()) == ["0123456789abcdef.8"]
    assert not list(tmp_path.glob("escape*")) and not (tmp_path / "store" / ".gdskv" / "escape.9").exists()
