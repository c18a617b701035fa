"""The remote tier against a real S3 HTTP endpoint (moto's server on a local port): config,
create-only uploads, read-through with verification, degradation when the endpoint is gone or
silent, leftovers uploaded at the next start, and stock zarr reading a page from the bucket.

Two nodes are two ``KvService`` stacks with separate local stores here; the engine end to end
in separate processes is ``tests/test_remote_nodes.py``.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from gdskv import format as fmt
from gdskv.config import ConfigError, GdsKvConfig, RemoteConfig, load_config
from gdskv.keys import chain_keys
from gdskv.remote import ObjectClient, Outcome
from gdskv.remote.objects import chunk_key
from gdskv.service import KvService
from gdskv.store import GroupSpec, NamespaceSpec
from gdskv.transfer import LoadStatus, SaveStatus
from remote_helpers import BUCKET, MotoEndpoint, SilentEndpoint, free_port, remote_table, wait_for

pytestmark = pytest.mark.usefixtures("aws_credentials")

TPB = 4
PAGE = 4096
SPEC = NamespaceSpec("remote-test", "float16", TPB, (GroupSpec(0, PAGE, (0, 1)), GroupSpec(1, PAGE // 2, (2,))))
TOKENS = list(range(1000, 1000 + 10 * TPB + 1))  # 10 full blocks
KEYS = chain_keys(TOKENS, TPB)


_prefixes = iter(range(1 << 30))


@pytest.fixture
def prefix():
    """A fresh key prefix in the shared bucket for each test."""
    return f"t{next(_prefixes)}"


def service(store: str, url: str, prefix: str, transfers: bool = True, **extra) -> KvService:
    cfg = GdsKvConfig(store_path=store, remote=remote_table(url, prefix, **extra))
    return KvService(cfg, SPEC, transfers=transfers)


def page(key: bytes, group: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:6], "little") + group)
    return torch.randint(0, 256, (SPEC.group(group).bytes_per_page,), dtype=torch.uint8, generator=g)


def save_all(svc: KvService, keys=KEYS) -> None:
    futs = [svc.save(g, k, keys[i - 1] if i else None, [page(k, g)]) for i, k in enumerate(keys) for g in (0, 1)]
    assert all(f.result(timeout=30) is SaveStatus.PUBLISHED for f in futs)


def load_ok(svc: KvService, keys) -> bool:
    for k in keys:
        for g in (0, 1):
            buf = torch.empty(SPEC.group(g).bytes_per_page, dtype=torch.uint8)
            if svc.load(g, k, [buf]).result(timeout=30) is not LoadStatus.LOADED or not torch.equal(buf, page(k, g)):
                return False
    return True


# --- config ---------------------------------------------------------------------------------------

def test_remote_section_from_toml(tmp_path):
    f = tmp_path / "g.toml"
    f.write_text('[gdskv]\nstore_path = "/s"\n[gdskv.remote]\nurl = "s3://my-bucket/kv/prod"\n'
                 'endpoint = "http://minio:9000"\nupload = "through"\ntimeout = "500ms"\n')
    rc = load_config(str(f)).remote
    assert (rc.bucket, rc.prefix, rc.endpoint, rc.upload, rc.timeout) == ("my-bucket", "kv/prod", "http://minio:9000", "through", 0.5)
    assert GdsKvConfig(store_path="/s").remote is None


@pytest.mark.parametrize("table, setting", [
    ({"url": "http://bucket/x"}, "remote.url"),
    ({"url": "s3://B_ad"}, "remote.url"),
    ({"url": "s3://ok-bucket", "upload": "sometimes"}, "remote.upload"),
    ({"url": "s3://ok-bucket", "timeout": "soon"}, "remote.timeout"),
    ({"url": "s3://ok-bucket", "timeout": 0}, "remote.timeout"),
    ({"url": "s3://ok-bucket", "endpoint": "minio:9000"}, "remote.endpoint"),
    ({"url": "s3://ok-bucket", "concurrency": 0}, "remote.concurrency"),
    ({"url": "s3://ok-bucket", "bucket_typo": 1}, "remote.bucket_typo"),
    ({"url": "s3://ok-bucket", "secret_access_key": "x"}, "credentials never go"),
])
def test_bad_remote_settings_fail_naming_the_setting(table, setting):
    with pytest.raises(ConfigError, match=setting):
        GdsKvConfig(store_path="/s", remote=table)


# --- the client: create-only uploads ----------------------------------------------------------------

def test_uploads_are_create_only(endpoint, prefix):
    client = ObjectClient(RemoteConfig(**remote_table(endpoint.url, prefix)))
    try:
        assert client.put_create("x/obj", b"first").outcome is Outcome.OK
        assert client.put_create("x/obj", b"second").outcome is Outcome.EXISTS
        assert client.get("x/obj").data == b"first"
        assert client.get("x/none").outcome is Outcome.MISSING
    finally:
        client.close()


def test_a_bucket_that_does_not_exist_refuses_uploads_and_misses_reads(tmp_path, endpoint, caplog):
    cfg = GdsKvConfig(store_path=str(tmp_path / "a"), remote={**remote_table(endpoint.url), "url": "s3://no-such-bucket/p"})
    svc = KvService(cfg, SPEC)
    with caplog.at_level(logging.WARNING, logger="gdskv.remote.upload"):
        save_all(svc, KEYS[:2])
        svc.close()
    assert svc.store is not None
    assert svc.namespace.counters["remote_upload_refused"] == 4 and svc.namespace.counters["remote_upload_failed"] == 0
    lookup = KvService(GdsKvConfig(store_path=str(tmp_path / "b"), remote=cfg.remote), SPEC, transfers=False)
    assert lookup.lookup(TOKENS, None).num_new_tokens == 0
    assert lookup.remote.counters["remote_unreachable"] == 0
    lookup.close()
    assert "NoSuchBucket" in caplog.text


# --- two nodes, one bucket ----------------------------------------------------------------------------

def test_node_b_reads_through_what_node_a_saved_then_serves_locally(tmp_path, endpoint, prefix):
    a = service(str(tmp_path / "a"), endpoint.url, prefix)
    save_all(a)
    a.close()  # drains the write-behind queue
    assert a.store is not None
    objects = endpoint.keys(f"{prefix}/")
    assert len([k for k in objects if "/c/" in k]) == 2 * len(KEYS)
    assert f"{prefix}/zarr.json" in objects and f"{prefix}/ns/{SPEC.namespace_id}/g1/zarr.json" in objects

    b_lookup = service(str(tmp_path / "b"), endpoint.url, prefix, transfers=False)
    found = b_lookup.lookup(TOKENS, None)
    assert found.num_new_tokens == 10 * TPB
    assert b_lookup.remote.counters["remote_hits"] == 2 * len(KEYS)
    b = service(str(tmp_path / "b"), endpoint.url, prefix)
    assert load_ok(b, KEYS)  # from the local store now
    again = b_lookup.lookup(TOKENS, None)
    assert again.num_new_tokens == 10 * TPB and b_lookup.remote.counters["remote_hits"] == 2 * len(KEYS)
    b.close()
    b_lookup.close()


def test_a_full_store_reads_a_whole_prefix_through_evicting_older_ones(tmp_path, endpoint, prefix):
    """Replies are published as they arrive, a block's sometimes before its parent's: on a store
    at its byte budget the budget makes room for each block, keeping the parent on its way,
    instead of refusing it as an orphan (which cut the prefix short there)."""
    tokens = list(range(5000, 5000 + 40 * TPB + 1))
    keys = chain_keys(tokens, TPB)
    a = service(str(tmp_path / "a"), endpoint.url, prefix, upload="through")
    save_all(a, keys)
    a.close()
    per_block = sum(a.namespace.chunk_nbytes(g) for g in (0, 1))
    # the deadline is not what this test is about: ample, so that a loaded CI machine cannot cut it short
    cfg = GdsKvConfig(store_path=str(tmp_path / "b"), remote=remote_table(endpoint.url, prefix, upload="off", timeout="20s"),
                      max_bytes=44 * per_block)
    b = KvService(cfg, SPEC)
    old = chain_keys(list(range(9000, 9000 + 40 * TPB + 1)), TPB)
    save_all(b, old)  # the store at its budget
    assert b.lookup(tokens, None).num_new_tokens == 40 * TPB, b.remote.counters.snapshot()
    assert b.remote.counters["remote_dropped_budget"] == 0
    assert all(b.namespace.contains_many(g, keys) == [True] * len(keys) for g in (0, 1))
    assert load_ok(b, keys)
    present = b.namespace.contains_many(0, old)  # what is left of the older prefix is a prefix of it
    assert present == sorted(present, reverse=True) and not all(present)
    b.close()


def test_an_engine_that_names_blocks_itself_reads_through_in_its_lease(tmp_path, endpoint, prefix):
    a = service(str(tmp_path / "a"), endpoint.url, prefix, upload="through")
    save_all(a, KEYS[:5])
    a.close()
    c = service(str(tmp_path / "c"), endpoint.url, prefix)  # MAX: held(..., lease=True) is its lookup
    assert c.held(0, KEYS, 0) == [False] * len(KEYS)
    # a lookup asks every leaf and shard by one deadline: one that has passed asks the remote nothing
    assert c.held(0, KEYS, 0, lease=True, deadline=c.lookup_deadline() - 60) == [False] * len(KEYS)
    assert c.remote.counters["remote_deadline"] == 1 and c.remote.counters["remote_hits"] == 0
    assert c.held(0, KEYS, 0, lease=True, deadline=c.lookup_deadline()) == [True] * 5 + [False] * 5
    assert c.remote.counters["remote_hits"] == 5 and c.namespace.contains_many(1, KEYS[:1]) == [False]
    c.close()


def test_a_corrupt_object_is_a_counted_miss_and_the_prefix_stops_there(tmp_path, endpoint, prefix, caplog):
    a = service(str(tmp_path / "a"), endpoint.url, prefix, upload="through")
    save_all(a)
    a.close()
    ns = a.namespace
    bad = f"{prefix}/{chunk_key(ns, 1, KEYS[6])}"
    data = bytearray(endpoint.s3.get_object(Bucket=BUCKET, Key=bad)["Body"].read())
    data[100] ^= 0x40
    endpoint.s3.put_object(Bucket=BUCKET, Key=bad, Body=bytes(data))

    b = service(str(tmp_path / "b"), endpoint.url, prefix, transfers=False)
    with caplog.at_level(logging.WARNING, logger="gdskv.remote.tier"):
        found = b.lookup(TOKENS, None)
    assert found.num_new_tokens == 6 * TPB
    assert b.remote.counters["remote_corrupt"] == 1
    assert "bad-checksum" in caplog.text
    assert not b.namespace.contains(1, KEYS[6])  # never published locally
    b.close()


def test_an_object_larger_than_a_chunk_is_refused_before_its_body_is_read(tmp_path, endpoint, prefix):
    """An object where a chunk belongs that is larger than a chunk is refused on the size its
    response declares, before its body is read: the client allocated the declared size up
    front, and an object of terabytes aborted the serving process."""
    a = service(str(tmp_path / "a"), endpoint.url, prefix, upload="through")
    save_all(a)
    a.close()
    big = f"{prefix}/{chunk_key(a.namespace, 0, KEYS[3])}"
    endpoint.s3.put_object(Bucket=BUCKET, Key=big, Body=os.urandom(4 << 20))
    client = ObjectClient(RemoteConfig(**remote_table(endpoint.url, prefix)))
    try:
        reply = client.get(chunk_key(a.namespace, 0, KEYS[3]), timeout=10, max_bytes=PAGE + fmt.TRAILER_BYTES)
        assert reply.outcome is Outcome.REFUSED and reply.data is None and "4194304 bytes" in reply.detail
    finally:
        client.close()
    b = service(str(tmp_path / "b"), endpoint.url, prefix, transfers=False)
    assert b.lookup(TOKENS, None).num_new_tokens == 3 * TPB  # served up to the oversized one
    assert b.remote.counters["remote_refused"] == 1 and not b.namespace.contains(0, KEYS[3])
    b.close()


# --- a remote that is gone or silent ------------------------------------------------------------------

def test_an_unreachable_endpoint_degrades_to_local_only_with_a_warning(tmp_path, caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="gdskv.remote.tier"):
        svc = service(str(tmp_path / "a"), url, "p", timeout="1s", drain="200ms")
        save_all(svc, KEYS[:3])  # saves are never held up by the remote
        t0 = time.monotonic()
        found = svc.lookup(TOKENS, None)
        took = time.monotonic() - t0
        assert found.num_new_tokens == 3 * TPB
        assert took < 1.0
        # counted and warned by whichever thread asked first, perhaps not this one
        assert wait_for(lambda: svc.remote.counters["remote_unreachable"] >= 1)
        assert wait_for(lambda: "unreachable" in caplog.text)
    t0 = time.monotonic()
    assert svc.lookup(TOKENS, None).num_new_tokens == 3 * TPB
    assert time.monotonic() - t0 < 0.2  # marked down: not asked again for retry_after
    svc.close()


def test_a_silent_endpoint_costs_a_lookup_at_most_its_timeout(tmp_path):
    silent = SilentEndpoint()
    try:
        svc = service(str(tmp_path / "a"), silent.url, "p", transfers=False, timeout="300ms")
        t0 = time.monotonic()
        found = svc.lookup(TOKENS, None)
        took = time.monotonic() - t0
        assert found.num_new_tokens == 0
        assert took < 0.3 + 0.2, took
        assert svc.remote.counters["remote_timeouts"] >= 1
        svc.close()
    finally:
        silent.close()


def test_write_behind_never_blocks_a_save(tmp_path):
    silent = SilentEndpoint()
    try:
        svc = service(str(tmp_path / "a"), silent.url, "p", timeout="2s", queue=2, drain="100ms")
        t0 = time.monotonic()
        save_all(svc)
        assert time.monotonic() - t0 < 2.0
        svc.close()
        assert svc.store is not None and load_ok(KvService(GdsKvConfig(store_path=str(tmp_path / "a")), SPEC), KEYS)
    finally:
        silent.close()


def test_what_was_not_uploaded_goes_up_at_the_next_start(tmp_path, endpoint, prefix):
    down = f"http://127.0.0.1:{free_port()}"
    a = service(str(tmp_path / "a"), down, prefix, drain="100ms")
    save_all(a)
    a.close()
    assert endpoint.keys(f"{prefix}/") == []
    again = service(str(tmp_path / "a"), endpoint.url, prefix)  # the next start, endpoint back
    assert wait_for(lambda: len([k for k in endpoint.keys(f"{prefix}/") if "/c/" in k]) == 2 * len(KEYS), 20)
    again.close()
    assert again.store is not None


def test_what_was_missed_goes_up_once_the_remote_answers_again(tmp_path, prefix):
    port = free_port()  # nothing listens there yet
    svc = service(str(tmp_path / "a"), f"http://127.0.0.1:{port}", prefix, retry_after="300ms", drain="5s")
    save_all(svc, KEYS[:4])
    assert wait_for(lambda: svc.remote.counters["remote_upload_failed"] >= 1, 5)
    late = MotoEndpoint(port)  # the remote comes back while the service runs
    try:
        time.sleep(0.4)  # past retry_after
        save_all(svc, KEYS[4:6])  # the next upload finds it answering: what was missed goes up too
        assert wait_for(lambda: len([k for k in late.keys(f"{prefix}/") if "/c/" in k]) == 2 * 6, 20)
        svc.close()
    finally:
        late.stop()


# --- stock zarr ---------------------------------------------------------------------------------------

def test_stock_zarr_reads_a_page_from_the_bucket(tmp_path, endpoint, prefix):
    import zarr
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    a = service(str(tmp_path / "a"), endpoint.url, prefix, upload="through")
    save_all(a, KEYS[:2])
    a.close()
    s3 = S3Store(BUCKET, prefix=prefix, endpoint=endpoint.url, region="us-east-1", client_options={"allow_http": True})
    root = zarr.open_group(ObjectStore(s3, read_only=True), mode="r")
    assert "gdskv" in root.attrs
    arr = root[f"ns/{SPEC.namespace_id}/g0"]
    hi, lo = fmt.chunk_index(a.namespace.store_key(0, KEYS[1]))
    got = arr[hi, :PAGE, lo]
    assert torch.equal(torch.from_numpy(got), page(KEYS[1], 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values are per thread on Linux only")
def test_upload_threads_run_niced_as_the_other_background_transfers(tmp_path, endpoint, prefix):
    def nice_of(thread: threading.Thread) -> Optional[int]:
        """None once the thread has ended (the leftovers sync of a fresh store ends at once)."""
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
        except FileNotFoundError:
            return None
        return int(stat.rsplit(")", 1)[1].split()[16])

    base = os.getpriority(os.PRIO_PROCESS, 0)
    cfg = GdsKvConfig(store_path=str(tmp_path / "a"), remote=remote_table(endpoint.url, prefix), background_nice=6)
    before = set(threading.enumerate())  # other tests' services may still be winding down
    svc = KvService(cfg, SPEC)
    uploaders = [t for t in threading.enumerate() if t.name.startswith("gdskv-upload-") and t not in before]
    workers = [t for t in uploaders if re.fullmatch(r"gdskv-upload-\d+", t.name)]  # live as long as the service
    assert workers
    assert wait_for(lambda: all(nice_of(t) in (None, min(19, base + 6)) for t in uploaders))
    assert all(nice_of(t) is not None for t in workers)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
    save_all(svc)  # and they still upload
    assert wait_for(lambda: len(endpoint.keys(prefix)) > 0)
    svc.close()


def test_hostile_bucket_entries_are_damaged_namespaces_and_skipped_keys(tmp_path, endpoint, prefix):
    """A namespace document nested past the JSON parser's depth is a damaged namespace, and a
    chunk key with a digit that is not ASCII is not a chunk: neither fails the commands that go
    over the whole bucket (they exited 1 for every namespace)."""
    from gdskv.remote.copy import inventory

    a = service(str(tmp_path / "a"), endpoint.url, prefix, upload="through")
    save_all(a)
    a.close()
    ns_id = a.namespace.id
    endpoint.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ns/{'0' * 16}/zarr.json", Body=b"[" * 100000 + b"]" * 100000)
    endpoint.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ns/{ns_id}/g\u00b2/c/1/0/2", Body=b"x")
    client = ObjectClient(RemoteConfig(**remote_table(endpoint.url, prefix)))
    try:
        found = {n.id: n for n in inventory(client)}
    finally:
        client.close()
    assert found["0" * 16].spec is None and "RecursionError" in found["0" * 16].damaged
    assert found[ns_id].spec is not None and sum(len(v) for v in found[ns_id].chunks.values()) == 2 * len(KEYS)


def test_verify_remote_reports_objects_of_a_layer_group_the_namespace_lacks(tmp_path, endpoint, prefix):
    """An object under ``g7`` of a namespace with groups 0 and 1 is a bad object of its own kind,
    reported; it ended the whole check with a KeyError."""
    from gdskv.remote.copy import verify_remote

    a = service(str(tmp_path / "a"), endpoint.url, prefix, upload="through")
    save_all(a)
    a.close()
    endpoint.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ns/{a.namespace.id}/g7/c/1/0/2", Body=b"x")
    client = ObjectClient(RemoteConfig(**remote_table(endpoint.url, prefix)))
    try:
        rep = verify_remote(client, None)
    finally:
        client.close()
    assert rep["ok"] == 2 * len(KEYS) and rep["reasons"] == {"unknown-group": 1}
    assert rep["bad_objects"] == [{"namespace": a.namespace.id, "group": 7, "key": f"ns/{a.namespace.id}/g7/c/1/0/2",
                                   "reason": "unknown-group"}]
