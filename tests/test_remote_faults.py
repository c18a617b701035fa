"""The remote tier under the failures a production bucket has: transient 5xx (``SlowDown``),
connections reset or cut, an endpoint that stops answering mid-operation. Faults are injected by
``remote_helpers.FaultyProxy``, a real HTTP proxy between the client and moto's S3 server."""
from __future__ import annotations

import time

import pytest

from gdskv.config import RemoteConfig
from gdskv.remote import ObjectClient, Outcome, RemoteUnavailable
from remote_helpers import BUCKET, FaultyProxy, first, remote_table

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
