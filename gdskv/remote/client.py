"""The object-store client of the remote tier: S3-compatible storage through ``obstore``.

One ``ObjectClient`` per remote tier. Requests run as coroutines on one event loop in a daemon
thread of this process (obstore's async API: many requests in flight from one thread, the GIL
released while bytes move); callers block on ``get_many`` / ``put_create`` / ``list`` with a
deadline, so no caller ever waits on the network longer than it was given.

Why obstore (``scripts/bench_remote.py`` measures it against boto3): it is what zarr 3's
``ObjectStore`` uses, its requests are made in Rust (bytes never pass through Python until they
are handed back), and it speaks the S3 conditional put (``If-None-Match: *``) that create-only
uploads need.

Credentials never come from gdskv's config: obstore reads the standard AWS environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, web identity, ECS and
instance metadata); where none is set and boto3 is installed, boto3's chain (profiles, SSO) is used.

Called by ``gdskv.remote.tier`` (reads and uploads), the CLI (``push``/``pull``/``--remote``) and
the benchmark.
"""
from __future__ import annotations

import asyncio
import enum
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Coroutine, Iterator, Optional, Sequence

from gdskv.config import RemoteConfig


RETURN_MARGIN = 0.04
"""The share of a deadline (at most 40 ms of it) left for handing the answers back: requests
still out then are abandoned, so the caller has its answer by the deadline."""


CLOSED = "the client was closed"
"""The detail of the ``UNREACHABLE`` replies of requests that a ``close`` cut short or came after it."""
CLOSED_POLL_S = 0.1
"""How often a caller waiting on a request checks whether the client was closed meanwhile."""


class RemoteSetupError(ValueError):
    """The remote settings cannot make a client (the message names the setting)."""


class Outcome(enum.Enum):
    """How one request ended."""

    OK = "ok"
    MISSING = "missing"
    EXISTS = "exists"
    """A create-only upload found the object there (412 Precondition Failed)."""
    REFUSED = "refused"
    """The remote answered no (permission, authentication, a bad request)."""
    UNREACHABLE = "unreachable"
    """No answer: connection refused or reset, DNS, a server error, the deadline."""


@dataclass
class Reply:
    """One request's answer: its outcome, and the bytes of a ``get``."""

    outcome: Outcome
    data: Any = None
    """The object's bytes (a buffer: ``memoryview(data)``) when ``OK``."""
    detail: str = ""


@dataclass(frozen=True)
class ObjectInfo:
    """One object a listing found."""

    key: str
    """Relative to the configured prefix (``ns/<id>/g0/c/<hi>/0/<lo>``)."""
    size: int
    mtime: float


_STATUS = re.compile(r"status code: (\d{3})")


def _classify(e: BaseException, writing: bool = False) -> Reply:
    """The outcome an obstore exception stands for. The HTTP status, where the message carries
    one, decides: 4xx is the remote saying no (``REFUSED``; 404 is ``MISSING`` for a read, a
    missing bucket for a write), 408/429/5xx and no status at all are ``UNREACHABLE``."""
    from obstore import exceptions as ox

    if isinstance(e, (ox.AlreadyExistsError, ox.PreconditionError)):
        return Reply(Outcome.EXISTS)
    if isinstance(e, FileNotFoundError):  # a missing object; or the bucket itself, which is a setting's mistake
        missing_bucket = "<Code>NoSuchBucket</Code>" in str(e)
        return Reply(Outcome.REFUSED, detail=_first_line(e)) if writing or missing_bucket else Reply(Outcome.MISSING)
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError, ox.InvalidPathError, ox.NotSupportedError)):
        return Reply(Outcome.REFUSED, detail=_first_line(e))
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return Reply(Outcome.UNREACHABLE, detail="timed out")
    if _BARE_REDIRECT in str(e):  # AWS S3's 301 to a bucket's own region: an answer, and a setting's mistake
        return Reply(Outcome.REFUSED, detail=_first_line(e))
    m = _STATUS.search(str(e))
    if m and m.group(1).startswith("4") and m.group(1) not in ("408", "429"):
        return Reply(Outcome.REFUSED, detail=_first_line(e))
    return Reply(Outcome.UNREACHABLE, detail=_first_line(e))


def _first_line(e: BaseException) -> str:
    """The exception's first line, and the S3 error code where the body names one (``code_note``)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    code = re.search(r"<Code>(\w+)</Code>", text)
    note = code_note(code.group(1)) if code else code_note("PermanentRedirect") if _BARE_REDIRECT in text else ""
    return f"{type(e).__name__}: {line[:240]}" + note


_BARE_REDIRECT = "Received redirect without LOCATION"
"""How obstore reports the 301 (without a ``Location``) that AWS S3 answers for a bucket of another region."""


SETTING_OF_CODE = {
    "NoSuchBucket": "remote.url names a bucket the endpoint does not have",
    "InvalidAccessKeyId": "the endpoint does not know the access key: check AWS_ACCESS_KEY_ID (or the profile)",
    "SignatureDoesNotMatch": "the secret key is not the access key's: check AWS_SECRET_ACCESS_KEY (or the profile)",
    "ExpiredToken": "the temporary credentials have expired: renew AWS_SESSION_TOKEN (or the role's)",
    "InvalidToken": "the session token is not valid: check AWS_SESSION_TOKEN",
    "AccessDenied": "the credentials may not use remote.url (docs/remote.md lists the permissions)",
    "AuthorizationHeaderMalformed": "remote.region is not the bucket's region",
    "PermanentRedirect": "remote.region (or remote.endpoint) is not the bucket's",
}
"""What to check for the S3 error codes that a wrong setting or credential causes."""


def code_note(code: str) -> str:
    """`` [<S3 error code>]``, with the setting to check where the code points at one
    (``SETTING_OF_CODE``). Called by ``_first_line`` and the own lister's errors."""
    return f" [{code}: {SETTING_OF_CODE[code]}]" if code in SETTING_OF_CODE else f" [{code}]"


class ObjectClient:
    """Requests against ``rc.url`` (bucket and prefix) at ``rc.endpoint``."""

    def __init__(self, rc: RemoteConfig, *, request_timeout: Optional[float] = None) -> None:
        """``request_timeout``: the HTTP client's own limit per request (default: the remote's
        ``timeout``, at least 1 s: the caller's deadline cuts a lookup shorter in any case)."""
        try:
            from obstore.store import S3Store
        except ImportError as e:
            raise RemoteSetupError(f"gdskv config: remote.url: the remote tier needs the obstore package, "
                                   f"which this interpreter cannot import ({e}); pip install 'obstore>=0.8'") from None

        self.rc = rc
        self.request_timeout = max(1.0, request_timeout if request_timeout is not None else rc.timeout)
        per_request = timedelta(seconds=self.request_timeout)
        config: dict[str, Any] = {}
        if rc.endpoint is not None:
            config["endpoint"] = rc.endpoint
        if rc.region is not None:
            config["region"] = rc.region
        elif rc.endpoint is not None and not os.environ.get("AWS_REGION") and not os.environ.get("AWS_DEFAULT_REGION"):
            config["region"] = "us-east-1"  # S3-compatible servers accept any; the signature needs one
        options = {"allow_http": bool(rc.endpoint and rc.endpoint.startswith("http://")), "timeout": per_request,
                   "connect_timeout": timedelta(seconds=min(per_request.total_seconds(), max(0.2, rc.timeout)))}
        retry = {"max_retries": 1, "retry_timeout": per_request,
                 "backoff": {"init_backoff": timedelta(milliseconds=20), "max_backoff": timedelta(milliseconds=200), "base": 2}}
        kwargs: dict[str, Any] = {}
        provider = _boto3_credentials()
        if provider is not None:
            kwargs["credential_provider"] = provider
        try:
            self.store = S3Store(rc.bucket, prefix=rc.prefix or None, config=config, client_options=options,
                                 retry_config=retry, **kwargs)
        except Exception as e:  # obstore's own configuration errors
            raise RemoteSetupError(f"gdskv config: remote.url {rc.url} / remote.endpoint {rc.endpoint}: {_first_line(e)}") from None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gdskv-remote", daemon=True)
        self._thread.start()
        self._limit: Optional[asyncio.Semaphore] = None
        self._workers = ThreadPoolExecutor(max_workers=min(rc.concurrency, 8), thread_name_prefix="gdskv-remote-take")
        self._closed = False

    # -- running coroutines ----------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        """Run ``coro`` on the client's loop; a concurrent future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _bounded(self, make: Callable[[], Coroutine[Any, Any, Reply]]) -> Reply:
        if self._limit is None:
            self._limit = asyncio.Semaphore(self.rc.concurrency)
        async with self._limit:
            return await make()

    # -- requests --------------------------------------------------------------------------------
    async def get_async(self, key: str, max_bytes: Optional[int] = None) -> Reply:
        """GET ``key`` on the client's loop; every failure an outcome (``_classify``). An object
        of more than ``max_bytes`` (its size as the response's headers give it) is ``REFUSED``
        before its body is read: a hostile or mistaken object of terabytes where a chunk
        belongs must not take the serving process's memory (the client allocated the declared
        size up front, and a failed allocation aborted the process)."""
        import obstore

        try:
            got = await obstore.get_async(self.store, key)
            size = int(got.meta["size"])
            if max_bytes is not None and size > max_bytes:
                return Reply(Outcome.REFUSED, detail=f"{key}: {size} bytes, more than the {max_bytes} it may hold")
            return Reply(Outcome.OK, await got.bytes_async())
        except BaseException as e:  # noqa: BLE001 - every failure is an outcome, never an exception
            if isinstance(e, asyncio.CancelledError):
                raise
            return _classify(e)

    async def put_async(self, key: str, data: bytes, create_only: bool = True) -> Reply:
        """PUT ``key`` on the client's loop (create-only: an existing object is ``EXISTS``);
        every failure an outcome."""
        import obstore

        try:
            await obstore.put_async(self.store, key, data, mode="create" if create_only else "overwrite", use_multipart=False)
            return Reply(Outcome.OK)
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, asyncio.CancelledError):
                raise
            return _classify(e, writing=True)

    def get_many(self, keys: Sequence[str], timeout: float, then: Optional[Callable[[int, Reply], Any]] = None,
                 in_order: bool = False, max_bytes: Optional[int] = None,
                 stop: Optional[Callable[[], bool]] = None, in_flight: Optional[int] = None) -> list[Any]:
        """GET every key (``concurrency`` in flight, started in the order given); what has not
        answered within ``timeout`` seconds is ``UNREACHABLE`` ("timed out"). With ``then``,
        each reply is handed to ``then(index, reply)`` on a worker thread as soon as it arrives
        (so verifying and publishing one object overlaps the transfer of the others), and the
        list holds what ``then`` returned, or the timed-out reply where it had not returned by
        the deadline. ``in_order``: once ``then`` returns something false for a key, keys after
        it whose request has not started are not asked (their entry is None). ``max_bytes``:
        as ``get_async``'s, for every key. ``stop``: asked after each ``then``; once it is true,
        keys whose request has not started are not asked (None), requests in flight are
        abandoned (the timed-out reply), and replies being handed to ``then`` are waited for
        (within ``timeout``, so the list says what ``then`` did): a pull gives up on a remote
        that stopped answering at its first reply saying so, not after every key has waited out
        its own timeout.
        ``in_flight``: at most that many of these requests at once (fewer than ``concurrency``
        where each reply is held whole and may be large: ``gdskv.remote.copy.fetch``)."""
        if not keys:
            return []
        loop = self._loop
        first_false = [len(keys)]
        stopped = [False]
        settling: set[asyncio.Task] = set()
        """The requests whose reply is being handed to ``then`` now."""

        async def ask(i: int, key: str) -> Optional[Reply]:
            if i > first_false[0] or stopped[0]:
                return None
            return await self.get_async(key, max_bytes)

        async def one(i: int, key: str, halt: asyncio.Event, mine: Optional[asyncio.Semaphore]) -> Any:
            if mine is None:
                reply = await self._bounded(lambda: ask(i, key))
            else:
                async with mine:
                    reply = await self._bounded(lambda: ask(i, key))
            if reply is None or then is None:
                return reply
            me = asyncio.current_task()
            settling.add(me)
            try:
                out = await loop.run_in_executor(self._workers, then, i, reply)
            finally:
                settling.discard(me)
            if in_order and not out:
                first_false[0] = min(first_false[0], i)
            if stop is not None and stop():
                stopped[0] = True
                halt.set()
            return out

        async def run() -> list[Any]:
            halt = asyncio.Event()
            mine = asyncio.Semaphore(max(1, in_flight)) if in_flight is not None else None
            tasks = [asyncio.ensure_future(one(i, k, halt, mine)) for i, k in enumerate(keys)]
            ends = [asyncio.ensure_future(asyncio.wait(tasks)), asyncio.ensure_future(halt.wait())]
            end = loop.time() + max(0.0, timeout - RETURN_MARGIN * min(1.0, timeout))
            await asyncio.wait(ends, timeout=end - loop.time(), return_when=asyncio.FIRST_COMPLETED)
            if halt.is_set() and settling:  # replies already being handed over end as they do (within the deadline)
                for t in tasks:
                    if t not in settling:
                        t.cancel()
                await asyncio.wait(list(settling), timeout=max(0.0, end - loop.time()))
            for t in tasks + ends:
                t.cancel()
            return [t.result() if t.done() and not t.cancelled() else Reply(Outcome.UNREACHABLE, detail="timed out")
                    for t in tasks]

        return self._answer(run(), [Reply(Outcome.UNREACHABLE, detail=CLOSED)] * len(keys))

    def put_create(self, key: str, data: bytes, timeout: Optional[float] = None) -> Reply:
        """Create ``key`` unless it exists (``If-None-Match: *``): ``OK`` or ``EXISTS``."""
        return self._wait(self._bounded(lambda: self.put_async(key, data)), timeout)

    def get(self, key: str, timeout: Optional[float] = None, max_bytes: Optional[int] = None) -> Reply:
        """GET one object (``get_async``), waiting at most ``timeout`` seconds."""
        return self._wait(self._bounded(lambda: self.get_async(key, max_bytes)), timeout)

    def _wait(self, coro: Coroutine[Any, Any, Reply], timeout: Optional[float]) -> Reply:
        if self._closed:
            coro.close()
            return Reply(Outcome.UNREACHABLE, detail=CLOSED)

        async def run() -> Reply:
            try:
                return await asyncio.wait_for(coro, timeout)
            except asyncio.TimeoutError:
                return Reply(Outcome.UNREACHABLE, detail="timed out")

        return self._answer(run(), Reply(Outcome.UNREACHABLE, detail=CLOSED))

    def _answer(self, coro: Coroutine[Any, Any, Any], closed: Any) -> Any:
        """``coro``'s result, run on the client's loop; ``closed`` where the client is closed
        before it ends (the stopped loop would never end it: a lookup waiting on the remote while
        the service shuts down would wait forever). Called by ``get_many`` and ``_wait``."""
        if self._closed:
            coro.close()
            return closed
        fut = self.submit(coro)
        while True:
            try:
                return fut.result(timeout=CLOSED_POLL_S)
            except FutureTimeout:
                if self._closed and not self._thread.is_alive():
                    fut.cancel()
                    return closed

    def list(self, prefix: str = "", unaddressable: Optional[Callable[[str], None]] = None) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (relative to the configured prefix; "" or ending in "/"),
        past any key obstore cannot name (``gdskv.remote.listing``: each such key is left out and
        handed to ``unaddressable``). Raises ``RemoteUnavailable`` when the listing fails."""
        from gdskv.remote.listing import list_objects

        return list_objects(self, prefix, unaddressable)

    def close(self) -> None:
        """Stop the loop thread (requests still in flight are abandoned). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._workers.shutdown(wait=False, cancel_futures=True)


class RemoteUnavailable(RuntimeError):
    """A request that has no per-key outcome (a listing) failed; the message says how,
    ``outcome`` whether the remote refused (``REFUSED``) or did not answer (``UNREACHABLE``)."""

    def __init__(self, message: str, outcome: Outcome = Outcome.UNREACHABLE) -> None:
        super().__init__(message)
        self.outcome = outcome


def _boto3_credentials() -> Any:
    """boto3's credential chain (profiles, SSO) when no AWS key is in the environment and boto3
    is installed; None otherwise (obstore's own chain: environment, web identity, ECS, IMDS)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_SKIP_SIGNATURE"):
        return None
    if not (os.environ.get("AWS_PROFILE") or os.path.exists(os.path.expanduser("~/.aws/credentials"))
            or os.path.exists(os.path.expanduser("~/.aws/config"))):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    return Boto3CredentialProvider(boto3.Session())
