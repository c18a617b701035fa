"""Two nodes, one bucket, end to end: separate processes, separate local stores, moto's S3 server.

Node A runs the reference engine with the TensorRT-LLM connector and saves (write-behind uploads,
drained at close). Node B, with an empty local store, serves the prompt's prefix from the bucket:
the same tokens and bit-identical logits as node A, whose run computed everything; its second run
(a fresh connector on the same store) is served from its local store without asking the remote.
"""
from __future__ import annotations

import pytest

from remote_helpers import prompt, remote_table, run_node

pytestmark = pytest.mark.slow


def test_node_b_serves_node_a_prefix_from_the_bucket_then_locally(tmp_path, endpoint, aws_credentials):
    prompts = [prompt(39, 1), prompt(20, 2) + prompt(13, 3)]  # 9 and 8 servable blocks (TPB 4)
    remote = remote_table(endpoint.url, "nodes")
    a = run_node({"store": str(tmp_path / "node-a"), "remote": remote, "prompts": prompts})["runs"][0]
    assert a["loaded"] == [0, 0]
    assert a["remote_worker"]["remote_uploaded"] == a["worker"]["saves_published"] > 0
    objects = endpoint.keys("nodes/")
    assert "nodes/zarr.json" in objects and len([k for k in objects if "/c/" in k]) == a["worker"]["saves_published"]

    b1, b2 = run_node({"store": str(tmp_path / "node-b"), "remote": remote, "prompts": prompts, "runs": 2})["runs"]
    assert b1["loaded"] == [36, 32]
    assert b1["tokens"] == a["tokens"] and b1["logits_sha"] == a["logits_sha"]
    assert b1["remote_scheduler"]["remote_hits"] == 9 + 8
    assert b1["worker"]["loads_loaded"] == 9 + 8 and b1["worker"]["loads_failed"] == 0
    assert b2["loaded"] == [36, 32] and b2["tokens"] == a["tokens"] and b2["logits_sha"] == a["logits_sha"]
    assert b2["remote_scheduler"].get("remote_hits", 0) == 0, "the second run is served locally"
    assert b2["remote_worker"].get("remote_uploaded", 0) == 0
