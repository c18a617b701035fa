"""Listing a bucket past the keys obstore cannot name: ListObjectsV2 over HTTP, signed here (SigV4).

obstore turns every key a listing returns into its ``Path``, which refuses a ``..`` or ``.``
segment, an empty segment (``a//b``, a leading ``/``) and an ASCII control character, and which
reads a key with a trailing ``/`` as another key. One such key in a listing's page fails the
whole listing, and no obstore call lists past it or reads it. Anyone who can write to a shared
bucket can put one, and gdskv itself never names an object so.

``list_objects`` lists with obstore and, where that fails on such a key, goes on with
``list_raw`` from the last key obstore gave: the same bucket, prefix, endpoint, region and
credentials, the keys exactly as the server sends them (``encoding-type=url``, so no key can
break the XML). Keys obstore cannot address (``addressable``) are left out and handed to the
caller's ``unaddressable``; the rest are listed as obstore lists them. The common case (no such
key) stays obstore's alone: its own credential chain, retries and connection pool. ``list_raw``
tries a page again where it got no answer (``_Signer.get``), as obstore retries its own requests.

Called by ``gdskv.remote.client.ObjectClient.list`` only.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import os
import random
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from typing import Callable, Iterator, Optional

from gdskv.remote.client import ObjectClient, ObjectInfo, Outcome, RemoteUnavailable, _classify, _first_line, code_note

LIST_ATTEMPTS = 3
"""Tries of one ListObjectsV2 page that gets no answer (``_Signer.get``)."""
LIST_BACKOFF_S = 0.1
"""The pause before the second try, doubled before each next (with jitter: half to all of it)."""
LIST_MAX_BACKOFF_S = 1.0
"""The longest pause between two tries."""

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_UNRESERVED = "-_.~"  # RFC 3986: what SigV4's canonical query leaves unencoded


def addressable(rel: str) -> bool:
    """Whether obstore names the object ``rel`` (relative to the store's prefix) exactly: no
    empty, ``.`` or ``..`` segment, no ASCII control character (``object_store``'s ``Path``)."""
    return bool(rel) and all(seg not in ("", ".", "..") for seg in rel.split("/")) \
        and not any(ord(c) < 32 or ord(c) == 127 for c in rel)


def list_objects(client: ObjectClient, prefix: str,
                 unaddressable: Optional[Callable[[str], None]]) -> Iterator[ObjectInfo]:
    """``ObjectClient.list``: obstore's listing, then ``list_raw``'s from its last key if a key
    obstore cannot name failed it. Raises ``RemoteUnavailable``."""
    import obstore
    from obstore.exceptions import InvalidPathError

    last = None
    try:
        for batch in obstore.list(client.store, prefix or None, chunk_size=1000):
            for meta in batch:
                last = str(meta["path"])
                yield ObjectInfo(last, int(meta["size"]), meta["last_modified"].timestamp())
        return
    except InvalidPathError:
        pass
    except Exception as e:  # noqa: BLE001
        reply = _classify(e)
        raise RemoteUnavailable(f"listing s3://{client.rc.bucket}/{client.rc.prefix}: {reply.outcome.value}: "
                                f"{reply.detail}", reply.outcome) from None
    yield from list_raw(client, prefix, last, unaddressable)


def list_raw(client: ObjectClient, prefix: str, after: Optional[str],
             unaddressable: Optional[Callable[[str], None]]) -> Iterator[ObjectInfo]:
    """The objects under ``prefix`` (relative to the configured prefix) whose key sorts after
    ``after`` (relative too; None: from the first), one ListObjectsV2 page at a time, each
    request within the client's ``request_timeout``; ``unaddressable(rel)`` for each key left
    out. Raises ``RemoteUnavailable``."""
    rc = client.rc
    base = f"{rc.prefix}/" if rc.prefix else ""
    signer = _Signer(client)
    params = {"list-type": "2", "encoding-type": "url", "prefix": base + prefix}
    if after is not None:
        params["start-after"] = base + after
    while True:
        page = signer.get(params, client.request_timeout)
        encoded = _text(page, "EncodingType") == "url"  # a server may ignore encoding-type and send keys as they are
        for item in _children(page, "Contents"):
            key = _text(item, "Key")
            rel = (urllib.parse.unquote_plus(key) if encoded else key)[len(base):]
            if not addressable(rel):
                if unaddressable is not None:
                    unaddressable(rel)
                continue
            try:
                info = ObjectInfo(rel, int(_text(item, "Size")),
                                  datetime.datetime.fromisoformat(_text(item, "LastModified")).timestamp())
            except ValueError as e:
                raise RemoteUnavailable(f"listing {signer.where}: refused: not a listing ({e})", Outcome.REFUSED) from None
            yield info
        if _text(page, "IsTruncated") != "true":
            return
        token = _text(page, "NextContinuationToken")
        if not token or token == params.get("continuation-token"):
            raise RemoteUnavailable(f"listing {signer.where}: refused: a truncated page without a new continuation "
                                    f"token", Outcome.REFUSED)
        params.pop("start-after", None)
        params["continuation-token"] = token


def _children(el: ET.Element, name: str) -> Iterator[ET.Element]:
    """``el``'s children named ``name``, in S3's XML namespace or in none (some S3-compatible servers)."""
    return (c for c in el if c.tag.rsplit("}", 1)[-1] == name)


def _text(el: ET.Element, name: str) -> str:
    return next((c.text or "" for c in _children(el, name)), "")


class _Signer:
    """GETs of the bucket, signed (AWS Signature Version 4) as obstore signs its own requests:
    the client's endpoint (``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT`` without one; AWS S3
    otherwise), path-style, its region, and the credentials obstore would use."""

    def __init__(self, client: ObjectClient) -> None:
        rc = client.rc
        self.region = rc.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        endpoint = (rc.endpoint or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
                    or f"https://s3.{self.region}.amazonaws.com")
        self.url = f"{endpoint.rstrip('/')}/{rc.bucket}"
        self.where = f"s3://{rc.bucket}/{rc.prefix}"
        self.credentials: Optional[tuple[str, str, Optional[str]]] = None
        if os.environ.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true", "yes", "on"):
            return
        try:
            self.credentials = _credentials(client)
        except Exception as e:  # noqa: BLE001 - a provider's own failure (a profile, metadata not answering)
            raise RemoteUnavailable(f"listing {self.where}: unreachable: credentials: {_first_line(e)}") from None
        if self.credentials is None:
            raise RemoteUnavailable(f"listing {self.where}: refused: the bucket holds a key obstore cannot list past, "
                                    f"and listing on needs AWS credentials in the environment or boto3", Outcome.REFUSED)

    def get(self, params: dict[str, str], timeout: float) -> ET.Element:
        """The parsed answer to ``GET <bucket>?<params>``, tried again where it got no answer
        (a 5xx such as 503 ``SlowDown``, 408, 429, a reset, a timeout, a body cut short) as
        obstore retries its own requests: at most ``LIST_ATTEMPTS`` tries, each within
        ``timeout``, backing off between them, and none started later than ``timeout`` after
        the first (so one page costs at most about twice ``timeout``). ``RemoteUnavailable``
        for any other answer, or the last try's failure. Called by ``list_raw`` for each page."""
        start, attempt = time.monotonic(), 1
        while True:
            try:
                return self._get_once(params, timeout)
            except RemoteUnavailable as e:
                pause = random.uniform(0.5, 1.0) * min(LIST_MAX_BACKOFF_S, LIST_BACKOFF_S * 2 ** (attempt - 1))
                if (e.outcome is not Outcome.UNREACHABLE or attempt >= LIST_ATTEMPTS
                        or time.monotonic() + pause - start > timeout):
                    raise
            time.sleep(pause)
            attempt += 1

    def _get_once(self, params: dict[str, str], timeout: float) -> ET.Element:
        """One try of ``get``."""
        query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(params.items()))
        headers = self._headers(query)
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{self.url}?{query}", headers=headers),
                                        timeout=timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            status, detail = e.code, _first_line(e) + _code_of(e)
            refused = 300 <= status < 500 and status not in (408, 429)  # a 3xx here had no location to follow
            raise RemoteUnavailable(f"listing {self.where}: {'refused' if refused else 'unreachable'}: {detail}",
                                    Outcome.REFUSED if refused else Outcome.UNREACHABLE) from None
        except (OSError, http.client.HTTPException, ValueError) as e:  # URLError, a reset, a timeout, a cut body
            raise RemoteUnavailable(f"listing {self.where}: unreachable: {_first_line(e)}") from None
        try:
            return ET.fromstring(body)
        except ET.ParseError as e:
            raise RemoteUnavailable(f"listing {self.where}: refused: not a listing ({e})", Outcome.REFUSED) from None

    def _headers(self, query: str) -> dict[str, str]:
        split = urllib.parse.urlsplit(self.url)
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        headers = {"host": split.netloc, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
        if self.credentials is None:
            return headers
        access_key, secret, token = self.credentials
        if token:
            headers["x-amz-security-token"] = token
        names = sorted(headers)
        canonical = "\n".join(["GET", urllib.parse.quote(split.path or "/", safe="/" + _UNRESERVED), query,
                               "".join(f"{n}:{headers[n]}\n" for n in names), ";".join(names), EMPTY_SHA256])
        scope = f"{amz_date[:8]}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key = ("AWS4" + secret).encode()
        for part in scope.split("/"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={signature}")
        return headers


def _quote(s: str) -> str:
    return urllib.parse.quote(s, safe=_UNRESERVED)


def _code_of(e: urllib.error.HTTPError) -> str:
    """`` [<S3 error code>]`` where the error's body names one."""
    try:
        code = _text(ET.fromstring(e.read()), "Code")
    except (OSError, http.client.HTTPException, ET.ParseError):
        return ""
    return code_note(code) if code else ""


def _credentials(client: ObjectClient) -> Optional[tuple[str, str, Optional[str]]]:
    """(access key, secret, session token) from where obstore gets them for ``client``'s store:
    the credential provider it was given (``gdskv.remote.client._boto3_credentials``), the
    environment, or else botocore's chain where boto3 is installed (web identity, ECS, instance
    metadata: obstore resolves these in Rust, out of reach from Python); None when none has any."""
    provider = client.store.credential_provider
    if provider is not None:
        c = provider()
        return c["access_key_id"], c["secret_access_key"], c.get("token")
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"], os.environ.get("AWS_SESSION_TOKEN")
    try:
        import botocore.session
    except ImportError:
        return None
    found = botocore.session.get_session().get_credentials()
    if found is None:
        return None
    frozen = found.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token
