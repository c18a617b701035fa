"""``gdskv push | pull`` and ``info | ls | stats | verify --remote`` against moto's S3 server."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from gdskv.cli.main import main
from gdskv.config import GdsKvConfig
from gdskv.keys import chain_keys
from gdskv.remote.objects import chunk_key
from gdskv.service import KvService
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from remote_helpers import BUCKET, save_chain

SPEC = NamespaceSpec("remote-cli", "float16", 4, (GroupSpec(0, 2048, (0,)),))
KEYS = chain_keys(list(range(6 * 4 + 1)), 4)


@pytest.fixture
def config(tmp_path, endpoint, aws_credentials, monkeypatch):
    f = tmp_path / "gdskv.toml"
    f.write_text(f'[gdskv]\n[gdskv.remote]\nurl = "s3://{BUCKET}/cli-{tmp_path.name}"\nendpoint = "{endpoint.url}"\n'
                 f'upload = "off"\n')
    monkeypatch.setenv("GDSKV_CONFIG", str(f))
    return f


def gdskv(store, *args: str):
    return CliRunner().invoke(main, ["--store", str(store), *args], catch_exceptions=False)


def local_store(path) -> KvService:
    svc = KvService(GdsKvConfig(store_path=str(path)), SPEC)
    save_chain(svc, KEYS, 5)
    return svc


def test_push_then_inspect_verify_and_pull_the_bucket(tmp_path, config, endpoint):
    a = local_store(tmp_path / "a")
    r = gdskv(tmp_path / "a", "push", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["uploaded"] == len(KEYS)
    again = json.loads(gdskv(tmp_path / "a", "push", "--json").output)
    assert again["uploaded"] == 0  # create-only: nothing replaced, nothing sent twice

    info = json.loads(gdskv(tmp_path / "a", "info", "--remote", "--json").output)
    assert info["chunks"] == len(KEYS) and info["namespaces"][0]["model"] == "remote-cli"
    ls = json.loads(gdskv(tmp_path / "a", "ls", "--remote", "--json", "--limit", "2").output)
    assert ls["total"] == len(KEYS) and len(ls["objects"]) == 2
    assert gdskv(tmp_path / "a", "verify", "--remote").exit_code == 0

    prefix = f"cli-{tmp_path.name}"
    bad = f"{prefix}/{chunk_key(a.namespace, 0, KEYS[2])}"
    body = bytearray(endpoint.s3.get_object(Bucket=BUCKET, Key=bad)["Body"].read())
    body[7] ^= 1
    endpoint.s3.put_object(Bucket=BUCKET, Key=bad, Body=bytes(body))
    r = gdskv(tmp_path / "a", "verify", "--remote", "--json")
    assert r.exit_code == 1 and json.loads(r.output)["reasons"] == {"bad-checksum": 1}

    r = gdskv(tmp_path / "b", "pull", "--json")
    assert r.exit_code == 1, r.output  # the bad object is counted and left out
    counts = json.loads(r.output)["counts"]
    assert counts == {"pulled": len(KEYS) - 1, "present": 0, "bad (bad-checksum)": 1}
    (ns,) = PageStore.open(tmp_path / "b", create=False).namespaces()
    assert ns.contains_many(0, KEYS) == [True, True, False, True, True, True]
    assert gdskv(tmp_path / "b", "verify").exit_code == 0
    stats = json.loads(gdskv(tmp_path / "b", "stats", "--remote", "--json").output)
    assert stats["namespaces"][SPEC.namespace_id]["chunks"] == len(KEYS)


def test_remote_commands_without_a_remote_are_usage_errors(tmp_path, monkeypatch):
    local_store(tmp_path / "a")
    monkeypatch.delenv("GDSKV_CONFIG", raising=False)
    for args in (("push",), ("pull",), ("info", "--remote"), ("verify", "--remote")):
        r = gdskv(tmp_path / "a", *args)
        assert r.exit_code == 2 and "no [gdskv.remote]" in r.output, (args, r.output)


def test_prewarm_remote_warms_the_bucket_once(tmp_path, config, endpoint):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox jumps over the lazy dog, again and again and again.\n\n"
                       "A second paragraph, long enough to fill a few blocks of sixteen tokens each.\n")
    r = gdskv(tmp_path / "a", "prewarm", str(prompts), "--remote", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["done"] == 2 and rep["remote"]["uploaded"] == rep["blocks_written"] > 0
    chunks = [k for k in endpoint.keys(f"cli-{tmp_path.name}/") if "/c/" in k]
    assert len(chunks) == rep["blocks_written"]


def test_push_to_a_bucket_that_does_not_exist_fails_in_one_line(tmp_path, config, endpoint):
    local_store(tmp_path / "a")
    config.write_text(config.read_text().replace(f"s3://{BUCKET}/", "s3://no-such-bucket/"))
    r = gdskv(tmp_path / "a", "push")
    assert r.exit_code == 1 and "NoSuchBucket" in r.output and "Traceback" not in r.output


def test_push_and_pull_only_the_blocks_of_a_prompt_file(tmp_path, config, endpoint):
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("A system prompt that every request of this service starts with, long enough for blocks.\n")
    two.write_text("Another document entirely, which only some other workload ever asks about at all.\n")
    assert gdskv(tmp_path / "a", "prewarm", str(one), str(two)).exit_code == 0
    blocks = len(one.read_text().strip().encode()) // 16  # the reference engine: bytes, 16 tokens per block
    r = gdskv(tmp_path / "a", "push", "--prompts", str(one), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["uploaded"] == blocks
    assert len([k for k in endpoint.keys(f"cli-{tmp_path.name}/") if "/c/" in k]) == blocks

    gdskv(tmp_path / "a", "push")  # now everything
    r = gdskv(tmp_path / "b", "pull", "--prompts", str(one), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["counts"] == {"pulled": blocks, "present": 0}
    (ns,) = PageStore.open(tmp_path / "b", create=False).namespaces()
    assert sum(1 for _ in ns.store.iter_chunk_files()) == blocks


def test_pull_into_a_store_at_its_budget_takes_whole_chains(tmp_path, config, endpoint):
    """Pulled objects are published as they arrive, a block's sometimes before its parent's: the
    budget makes room for each, keeping the parent on its way, instead of refusing it as an orphan."""
    keys = chain_keys(list(range(40 * 4 + 1)), 4)
    a = KvService(GdsKvConfig(store_path=str(tmp_path / "a")), SPEC)
    save_chain(a, keys, 6)
    assert gdskv(tmp_path / "a", "push").exit_code == 0
    chunk = a.namespace.chunk_nbytes(0)
    config.write_text(config.read_text().replace("[gdskv]\n", f"[gdskv]\nmax_bytes = {44 * chunk}\n", 1))
    b = KvService(GdsKvConfig(store_path=str(tmp_path / "b"), max_bytes=44 * chunk), SPEC)
    old = chain_keys(list(range(9000, 9000 + 40 * 4 + 1)), 4)
    for i, k in enumerate(old):  # the store at its budget
        assert b.save(0, k, old[i - 1] if i else None, [torch.zeros(2048, dtype=torch.uint8)]).result()
    b.close()
    r = gdskv(tmp_path / "b", "pull", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["counts"] == {"pulled": len(keys), "present": 0}
    (ns,) = PageStore.open(tmp_path / "b", create=False).namespaces()
    assert ns.contains_many(0, keys) == [True] * len(keys)
    present = ns.contains_many(0, old)  # what is left of the older chain is a prefix of it
    assert present == sorted(present, reverse=True) and not all(present)
