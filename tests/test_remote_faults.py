"""The remote tier under the failures a production bucket has: transient 5xx (``SlowDown``),
connections reset or cut, an endpoint that stops answering mid-operation. Faults are injected by
``remote_helpers.FaultyProxy``, a real HTTP proxy between the client and moto's S3 server."""
from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from gdskv.cli.main import main
from gdskv.config import GdsKvConfig, RemoteConfig
from gdskv.keys import chain_keys
from gdskv.remote import ObjectClient, Outcome, RemoteUnavailable
from gdskv.remote.copy import pull, push, verify_remote
from gdskv.service import KvService
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from remote_helpers import BUCKET, FaultyProxy, first, remote_table, save_chain

pytestmark = pytest.mark.usefixtures("aws_credentials")

_prefixes = iter(range(1 << 30))


@pytest.fixture
def prefix():
    return f"f{next(_prefixes)}"


def own_lister(method: str, path: str, headers) -> bool:
    """The listing requests ``gdskv.remote.listing.list_raw`` signs and sends itself (urllib)."""
    return method == "GET" and "list-type=2" in path and headers.get("User-Agent", "").startswith("Python-urllib")


def listed_past_a_hostile_key(endpoint, prefix: str, n: int = 5) -> list[str]:
    """``n`` objects under ``prefix/ns/`` and one key obstore cannot name first, so the listing
    is the own lister's from its first page on."""
    endpoint.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ns//a", Body=b"x")
    names = [f"ns/x/k{i}" for i in range(n)]
    for rel in names:
        endpoint.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=b"y")
    return names


@pytest.mark.parametrize("what", ["503", "500", "reset", "cut"])
def test_the_own_lister_retries_a_transient_failure(endpoint, prefix, what):
    """Two failed ListObjectsV2 requests in a row (a SlowDown, a server error, a reset, a body cut
    short) and the listing still lists everything, as obstore's own listing does. Before, the
    first one failed the whole listing (``pull``, the ``--remote`` views, the leftover upload)."""
    names = listed_past_a_hostile_key(endpoint, prefix)
    proxy = FaultyProxy(endpoint.url, first(2, own_lister, what))
    client = ObjectClient(RemoteConfig(**remote_table(proxy.url, prefix)))
    try:
        left_out: list[str] = []
        assert [o.key for o in client.list("ns/", left_out.append)] == names
        assert left_out == ["ns//a"]
        assert len([r for r in proxy.requests if own_lister(r[0], r[1], {"User-Agent": r[2]})]) == 3
    finally:
        client.close()
        proxy.close()


def test_the_own_lister_gives_up_after_a_few_tries_within_its_timeout(endpoint, prefix):
    """A SlowDown storm: a few tries, backing off, then ``RemoteUnavailable`` (unreachable); a
    server that never answers costs at most about the configured timeout per try."""
    listed_past_a_hostile_key(endpoint, prefix)
    proxy = FaultyProxy(endpoint.url, lambda m, p, h: "503" if own_lister(m, p, h) else None)
    client = ObjectClient(RemoteConfig(**remote_table(proxy.url, prefix, timeout="1s")))
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable) as e:
            list(client.list("ns/"))
        assert e.value.outcome is Outcome.UNREACHABLE and "SlowDown" in str(e.value)
        assert time.monotonic() - t0 < 3
        assert 2 <= len([r for r in proxy.requests if r[2].startswith("Python-urllib")]) <= 4
        proxy.requests.clear()
        proxy.fault = lambda m, p, h: "stall" if own_lister(m, p, h) else None
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            list(client.list("ns/"))
        took = time.monotonic() - t0
        assert took < 2 * client.request_timeout + 1, took  # the retry window is the request timeout
    finally:
        client.close()
        proxy.close()


# --- an endpoint that stops answering in the middle of a pull or verify ----------------------------

SPEC = NamespaceSpec("remote-faults", "float16", 4, (GroupSpec(0, 256, (0,)),))


def bucket_of(tmp_path, endpoint, prefix: str, n: int) -> list[bytes]:
    """A store of ``n`` chained blocks, pushed under ``prefix``; their keys."""
    keys = chain_keys(list(range(n * 4 + 1)), 4)
    a = KvService(GdsKvConfig(store_path=str(tmp_path / "a"), remote=remote_table(endpoint.url, prefix, upload="off")), SPEC)
    save_chain(a, keys, 3)
    up = ObjectClient(RemoteConfig(**remote_table(endpoint.url, prefix)))
    try:
        assert push([a.namespace], up, up.rc, None).counts["remote_uploaded"] == n
    finally:
        up.close()
    return keys


def chunk_get(method: str, path: str, headers) -> bool:
    return method == "GET" and "/c/" in path


@pytest.mark.parametrize("what", ["pull", "verify"])
def test_a_pull_or_verify_stops_once_the_endpoint_stops_answering(tmp_path, endpoint, prefix, what):
    """The endpoint hangs after the listing (every chunk GET stalls): the pull (or ``verify
    --remote``) ends after the requests in flight time out, counting every chunk unreachable,
    instead of waiting out each batch of 256 in turn (19 s here, for 300 chunks and a 1 s request
    timeout; up to a minute a batch for the CLI's 30 s: hours for a large bucket)."""
    n = 300
    bucket_of(tmp_path, endpoint, prefix, n)
    proxy = FaultyProxy(endpoint.url, lambda m, p, h: "stall" if chunk_get(m, p, h) else None)
    client = ObjectClient(RemoteConfig(**remote_table(proxy.url, prefix, timeout="1s")), request_timeout=1.0)
    try:
        t0 = time.monotonic()
        if what == "pull":
            rep = pull(PageStore.open(tmp_path / "b", create=True), client, None)
            counts, unreachable = dict(rep.counts), rep.unreachable
        else:
            rep = verify_remote(client, None)
            counts, unreachable = rep["reasons"], rep["unreachable"]
        took = time.monotonic() - t0
        assert counts == ({"present": 0, "unreachable": n} if what == "pull" else {"unreachable": n})
        assert took < 8, took
        assert len([r for r in proxy.requests if chunk_get(r[0], r[1], {})]) <= 2 * client.rc.concurrency
        assert "timed out" in unreachable or "error" in unreachable.lower(), unreachable
    finally:
        client.close()
        proxy.close()


def test_gdskv_pull_from_a_bucket_in_a_slowdown_storm_says_so_in_one_line(tmp_path, endpoint, prefix, monkeypatch):
    """Every chunk GET answered 503 SlowDown: ``gdskv pull`` stops asking once the remote does
    not answer (before, it asked for every chunk of the bucket, twice with obstore's retry), says
    in its one line that the remote was unreachable, and exits 1."""
    n = 300
    bucket_of(tmp_path, endpoint, prefix, n)
    proxy = FaultyProxy(endpoint.url, lambda m, p, h: "503" if chunk_get(m, p, h) else None)
    config = tmp_path / "gdskv.toml"
    config.write_text(f'[gdskv]\n[gdskv.remote]\nurl = "s3://{BUCKET}/{prefix}"\nendpoint = "{proxy.url}"\n')
    monkeypatch.setenv("GDSKV_CONFIG", str(config))
    try:
        r = CliRunner().invoke(main, ["--store", str(tmp_path / "b"), "pull"], catch_exceptions=False)
        assert r.exit_code == 1, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
        assert f"{n} unreachable" in r.output and "remote unreachable:" in r.output and "SlowDown" in r.output, r.output
        assert len([q for q in proxy.requests if chunk_get(q[0], q[1], {})]) <= 4 * 16
        r = CliRunner().invoke(main, ["--store", str(tmp_path / "b"), "pull", "--json"], catch_exceptions=False)
        assert r.exit_code == 1 and "SlowDown" in json.loads(r.output)["unreachable"]
    finally:
        proxy.close()


# --- wrong settings: a bucket, credentials or a region the endpoint does not take ------------------

def enforce_auth(endpoint, after: str) -> None:
    """moto checks every request's signature against its IAM users from the ``after``-th request on
    ("inf": never): the test credentials are then unknown to it (``InvalidAccessKeyId``)."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{endpoint.url}/moto-api/reset-auth", data=after.encode(),
                                                  headers={"Content-Type": "text/plain"})).close()


@pytest.mark.parametrize("mistake", ["bucket", "credentials", "region", "region-redirect"])
def test_wrong_settings_are_named_by_the_cli_and_warned_once_by_a_serving_node(tmp_path, endpoint, prefix, monkeypatch,
                                                                             caplog, mistake):
    """A bucket the endpoint lacks, credentials it does not know, a region that is not the
    bucket's (a 400, or a 301 without a location): ``gdskv pull`` fails in one line that names
    what to check, and a serving node whose reads are all refused warns once, naming it too (its
    reads are misses). Before, the CLI gave the S3 code alone, and the serving node said nothing:
    its reads of a missing bucket were plain misses, a refused read only a counter; a redirect
    was an unreachable remote, its message cut off before the word region."""
    import logging

    keys = bucket_of(tmp_path, endpoint, prefix, 3)
    url, upstream, proxy = f"s3://{BUCKET}/{prefix}", endpoint.url, None
    if mistake == "bucket":
        url = f"s3://no-such-bucket/{prefix}"
    if mistake.startswith("region"):  # as AWS S3 answers a request signed for, or sent to, another region
        answer = "400 AuthorizationHeaderMalformed" if mistake == "region" else "301 PermanentRedirect"
        proxy = FaultyProxy(endpoint.url, lambda m, p, h: answer)
        upstream = proxy.url
    setting = {"bucket": "remote.url", "credentials": "AWS_ACCESS_KEY_ID"}.get(mistake, "remote.region")
    config = tmp_path / "gdskv.toml"
    config.write_text(f'[gdskv]\n[gdskv.remote]\nurl = "{url}"\nendpoint = "{upstream}"\n')
    monkeypatch.setenv("GDSKV_CONFIG", str(config))
    if mistake == "credentials":
        enforce_auth(endpoint, "0")
    try:
        r = CliRunner().invoke(main, ["--store", str(tmp_path / "b"), "pull"], catch_exceptions=False)
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
        assert setting in r.output, r.output
        remote = remote_table(upstream, prefix, url=url, upload="off")
        node = KvService(GdsKvConfig(store_path=str(tmp_path / "c"), remote=remote), SPEC, transfers=False)
        tokens = list(range(3 * 4 + 1))
        with caplog.at_level(logging.WARNING, logger="gdskv.remote.tier"):
            assert node.lookup(tokens, None).num_new_tokens == 0
            assert node.lookup(tokens[:-1] + [99, 98, 97, 96, 95], None).num_new_tokens == 0
        counters = node.remote.counters
        assert not node.namespace.contains_many(0, keys)[0]
        node.close()
        warnings = [rec.getMessage() for rec in caplog.records if rec.name == "gdskv.remote.tier"]
        assert len(warnings) == 1 and setting in warnings[0], warnings
        assert counters["remote_refused"] >= 1 and counters["remote_hits"] == 0
    finally:
        if mistake == "credentials":
            enforce_auth(endpoint, "inf")
        if proxy is not None:
            proxy.close()


def test_a_push_the_remote_refuses_says_refused_not_unreachable(tmp_path, endpoint, prefix, monkeypatch):
    """Credentials the endpoint does not know: ``gdskv push`` fails in one line that says the
    remote refused and names the credentials; it said "remote unreachable" before."""
    bucket_of(tmp_path, endpoint, prefix, 3)
    config = tmp_path / "gdskv.toml"
    config.write_text(f'[gdskv]\n[gdskv.remote]\nurl = "s3://{BUCKET}/{prefix}-2"\nendpoint = "{endpoint.url}"\n')
    monkeypatch.setenv("GDSKV_CONFIG", str(config))
    enforce_auth(endpoint, "0")
    try:
        r = CliRunner().invoke(main, ["--store", str(tmp_path / "a"), "push"], catch_exceptions=False)
        j = CliRunner().invoke(main, ["--store", str(tmp_path / "a"), "push", "--json"], catch_exceptions=False)
    finally:
        enforce_auth(endpoint, "inf")
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "refused" in r.output and "unreachable" not in r.output and "AWS_ACCESS_KEY_ID" in r.output, r.output
    doc = json.loads(j.stdout)
    assert j.exit_code == 1 and doc["unreachable"] is None and "AWS_ACCESS_KEY_ID" in doc["refused_listing"], j.stdout


# --- a bucket whose namespace document declares huge pages -----------------------------------------

@pytest.mark.parametrize("what", ["pull", "verify"])
def test_a_pull_holds_a_bounded_number_of_bytes_in_flight(tmp_path, endpoint, prefix, monkeypatch, what):
    """``pull`` and ``verify --remote`` take a chunk's size from the bucket's ``zarr.json``, which
    anyone who can write to the bucket may declare as up to 4 GiB, and each object in flight is
    held whole: ``concurrency`` of them (16 by default, up to 256) were fetched at once whatever
    their size, up to 1 TiB held at once. Now as many are in flight as fit ``BYTES_IN_FLIGHT``
    (at least one), here lowered to three chunks."""
    from gdskv.remote import copy
    from gdskv.format import TRAILER_BYTES

    n = 24
    bucket_of(tmp_path, endpoint, prefix, n)
    monkeypatch.setattr(copy, "BYTES_IN_FLIGHT", 3 * (256 + TRAILER_BYTES))
    proxy = FaultyProxy(endpoint.url, lambda m, p, h: "slow" if chunk_get(m, p, h) else None)
    client = ObjectClient(RemoteConfig(**remote_table(proxy.url, prefix)))
    try:
        if what == "pull":
            assert dict(pull(PageStore.open(tmp_path / "b", create=True), client, None).counts) == {"present": 0, "pulled": n}
        else:
            assert verify_remote(client, None)["ok"] == n
        assert 1 <= proxy.most_in_flight <= 3, proxy.most_in_flight
    finally:
        client.close()
        proxy.close()


@pytest.mark.parametrize("command", [["pull"], ["verify", "--remote"], ["info", "--remote", "--json"]])
def test_namespace_documents_that_get_no_answer_are_an_unreachable_remote_not_damage(tmp_path, endpoint, prefix,
                                                                                      monkeypatch, command):
    """The remote answers the listing, then not the GET of a namespace's ``zarr.json`` (a 503
    storm, the endpoint going away): the command says the remote was unreachable, in one line,
    exit 1. Before, each such namespace was reported damaged (``damaged_namespaces``, ``bad:
    damaged namespace``) as if the bucket held a broken document."""
    bucket_of(tmp_path, endpoint, prefix, 2)
    proxy = FaultyProxy(endpoint.url, lambda m, p, h: "503" if m == "GET" and p.endswith("/zarr.json") else None)
    config = tmp_path / "gdskv.toml"
    config.write_text(f'[gdskv]\n[gdskv.remote]\nurl = "s3://{BUCKET}/{prefix}"\nendpoint = "{proxy.url}"\n')
    monkeypatch.setenv("GDSKV_CONFIG", str(config))
    try:
        r = CliRunner().invoke(main, ["--store", str(tmp_path / "a"), *command], catch_exceptions=False)
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
        assert "damaged" not in r.output and "unreachable" in r.output and "SlowDown" in r.output, r.output
    finally:
        proxy.close()


# --- a service closed while a lookup waits on the remote ---------------------------------------------

def test_a_lookup_waiting_on_the_remote_returns_when_the_service_closes(tmp_path):
    """An engine shutting down closes the service while its scheduler's lookup waits on a remote
    that does not answer: the lookup returns (a miss) instead of waiting forever on the stopped
    client loop (before, its thread never returned, and an engine that joins it hung at shutdown);
    a request made after the close answers at once."""
    import threading

    from remote_helpers import SilentEndpoint

    silent = SilentEndpoint()
    try:
        svc = KvService(GdsKvConfig(store_path=str(tmp_path / "a"), remote=remote_table(silent.url, "p", timeout="5s")),
                        SPEC, transfers=False)
        client = svc.remote.client
        found: list[int] = []
        t = threading.Thread(target=lambda: found.append(svc.lookup(list(range(4 * 4 + 1)), None).num_new_tokens),
                             daemon=True)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        svc.close()
        t.join(3)
        assert found == [0] and time.monotonic() - t0 < 3
        assert client.get("x", timeout=5).outcome is Outcome.UNREACHABLE
        assert client.get_many(["x"], 5)[0].outcome is Outcome.UNREACHABLE
    finally:
        silent.close()


def test_uploads_the_remote_refuses_are_warned_once_not_per_chunk(tmp_path, endpoint, prefix, caplog):
    """Credentials the endpoint does not know refuse every upload: a serving node says so once
    (per ``retry_after``), naming what to check, and counts the rest. Before, it logged two
    warnings for every chunk it saved (the namespace document, then the chunk): a log line per
    page at the save rate."""
    import logging

    keys = chain_keys(list(range(8 * 4 + 1)), 4)
    enforce_auth(endpoint, "0")
    try:
        svc = KvService(GdsKvConfig(store_path=str(tmp_path / "a"), remote=remote_table(endpoint.url, prefix,
                                                                                       upload="through")), SPEC)
        counters = svc.namespace.counters
        with caplog.at_level(logging.WARNING, logger="gdskv.remote"):
            save_chain(svc, keys, 5)
    finally:
        enforce_auth(endpoint, "inf")
    assert counters["remote_upload_refused"] == len(keys)
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("gdskv.remote") and "refused" in r.getMessage()]
    assert len(warnings) == 1 and "AWS_ACCESS_KEY_ID" in warnings[0], warnings


def test_a_pull_over_a_slow_link_is_given_the_time_its_bytes_need(tmp_path, endpoint, prefix, monkeypatch):
    """Each batch of a pull had 60 s whatever its size (256 chunks of 16 MiB need 4 GiB to move:
    70 MB/s), and a batch cut short by it now stops the pull as an unreachable remote. A batch
    is given the time its bytes need at ``SLOWEST_RATE`` (at least ``BATCH_MIN_S``); here both are
    scaled down, so that a link of about 3 KiB/s pulls every chunk."""
    from gdskv.format import TRAILER_BYTES
    from gdskv.remote import copy

    n = 24
    bucket_of(tmp_path, endpoint, prefix, n)
    monkeypatch.setattr(copy, "BYTES_IN_FLIGHT", 256 + TRAILER_BYTES)  # one at a time: 24 x 100 ms
    monkeypatch.setattr(copy, "BATCH_MIN_S", 1.0)
    monkeypatch.setattr(copy, "SLOWEST_RATE", 1024)
    proxy = FaultyProxy(endpoint.url, lambda m, p, h: "slow" if chunk_get(m, p, h) else None)
    client = ObjectClient(RemoteConfig(**remote_table(proxy.url, prefix, timeout="1s")))
    try:
        rep = pull(PageStore.open(tmp_path / "b", create=True), client, None)
        assert dict(rep.counts) == {"present": 0, "pulled": n} and not rep.unreachable
    finally:
        client.close()
        proxy.close()


def test_the_endpoint_going_away_mid_pull_and_mid_lookup(tmp_path, prefix):
    """A moto server of this test's own is stopped while a pull fetches (after 40 chunk GETs),
    and again while a serving node reads a prefix through: the pull ends within seconds with
    what it had verified published and the rest counted unreachable (exit-1 counts); the lookup
    returns within its timeout with the blocks it had, and the local store holds only sound
    chunks."""
    from remote_helpers import MotoEndpoint

    own = MotoEndpoint()
    stopped = []
    try:
        n = 300
        keys = bucket_of(tmp_path, own, prefix, n)
        port = own.port

        def stop_after(limit: int):
            seen = [0]

            def fault(m: str, p: str, h) -> None:
                if chunk_get(m, p, h):
                    seen[0] += 1
                    if seen[0] == limit and not stopped:
                        stopped.append(True)
                        own.stop()
                return None
            return fault

        proxy = FaultyProxy(own.url, stop_after(40))
        client = ObjectClient(RemoteConfig(**remote_table(proxy.url, prefix)), request_timeout=2.0)
        store = PageStore.open(tmp_path / "b", create=True)
        t0 = time.monotonic()
        rep = pull(store, client, None)
        took = time.monotonic() - t0
        client.close()
        assert took < 10, took
        assert 0 < rep.counts["pulled"] < n and rep.counts["pulled"] + rep.counts["unreachable"] == n, rep.counts
        assert rep.unreachable
        (ns,) = store.namespaces()
        assert sum(ns.contains_many(0, keys)) == rep.counts["pulled"]
        assert CliRunner().invoke(main, ["--store", str(tmp_path / "b"), "verify"]).exit_code == 0

        own = MotoEndpoint(port)  # back (moto keeps its objects in this process), then away again mid-lookup
        stopped.clear()
        proxy.fault = stop_after(20)
        node = KvService(GdsKvConfig(store_path=str(tmp_path / "c"), remote=remote_table(proxy.url, prefix, timeout="1s",
                                                                                        upload="off")), SPEC,
                         transfers=False)
        t0 = time.monotonic()
        found = node.lookup(list(range(n * 4 + 1)), None)
        took = time.monotonic() - t0
        node.close()
        assert stopped and took < 1.5, took
        assert 0 <= found.num_new_tokens < n * 4
        assert CliRunner().invoke(main, ["--store", str(tmp_path / "c"), "verify"]).exit_code == 0
        proxy.close()
    finally:
        if not stopped:
            own.stop()
