"""Whole-namespace copies between the local store and the remote, and what the bucket holds.

- ``push``: every local chunk of the chosen namespaces (or of a prompt file's blocks,
  ``prompt_blocks``) that the remote lacks goes up
  (create-only, verified first, metadata first) — ``gdskv push``, and ``gdskv prewarm --remote``
  after its prompts ran, so a fleet is warmed once;
- ``pull``: every remote chunk of the chosen namespaces (or of a prompt file's blocks) that the
  local store lacks comes down,
  verified like a read-through, published atomically — ``gdskv pull``;
- ``inventory`` / ``verify_remote``: the bucket's namespaces (from their ``zarr.json``), chunk
  counts and bytes per layer group, and a check of every remote chunk — ``gdskv info|ls|stats|verify
  --remote``.

Keys no client can address (``gdskv.remote.listing``: a ``..`` or empty segment, ...) are left
out of every listing and reported: the keys themselves to ``unaddressable``, a count to the
commands.

Called by the CLI only; everything goes through ``ObjectClient`` (no other S3 code).
"""
from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from gdskv import format as fmt
from gdskv.config import RemoteConfig
from gdskv.keys import chain_keys
from gdskv.remote.client import ObjectClient, ObjectInfo, Outcome, RemoteUnavailable, Reply
from gdskv.remote.objects import METADATA_MAX_BYTES, chunk_key, publish, verify
from gdskv.remote.upload import Uploader
from gdskv.store import NAMESPACE_ATTR, NAMESPACE_ID, Namespace, NamespaceSpec, PageStore

GET_BATCH = 256
"""Objects fetched per batch by ``pull`` and ``verify_remote``."""
BATCH_MIN_S = 60.0
"""The least time a batch of GETs is given to end (a GET that gets no answer ends it sooner)."""
SLOWEST_RATE = 8 << 20
"""Bytes per second: a batch is given the time its objects need at this rate, where that is
more than ``BATCH_MIN_S`` (256 chunks of 16 MiB: 512 s), so that large pages over a slow link
are pulled, not cut off and taken for an unreachable remote. Fewer objects are fetched at
once where their bytes at this rate would not fit one request's own timeout."""
BYTES_IN_FLIGHT = 1 << 30
"""The most bytes of chunk objects ``pull`` and ``verify_remote`` fetch at once (at least one
object): each reply is held whole until checked, and a chunk's size comes from the bucket's
``zarr.json``, which may declare pages of up to 4 GiB."""


class _Health:
    """For a one-shot copy: the remote is reachable until a request says otherwise."""

    def __init__(self) -> None:
        self.reachable = True
        self.detail = ""

    def unreachable(self, ns: Optional[Namespace], detail: str) -> None:
        """A request got no answer: nothing more is asked; the first such answer says why."""
        self.reachable = False
        self.detail = self.detail or detail


@dataclass
class CopyReport:
    """What a push or pull did, per outcome."""

    counts: Counter = field(default_factory=Counter)
    unreachable: str = ""
    """Why the remote could not be reached, when so."""
    refused: str = ""
    """Why the remote refused a push's listing (credentials, bucket, region), when it did."""
    unaddressable: set[str] = field(default_factory=set)
    """The keys a pull's listings left out (``gdskv.remote.listing.addressable``)."""

    def add(self, ns: Optional[Namespace], name: str, n: int = 1) -> None:
        """Count ``n`` of outcome ``name``; the ``Uploader``'s count callback too (which names the
        namespace, summed over here)."""
        with _lock:
            self.counts[name] += n


_lock = threading.Lock()


BlocksOf = Callable[[NamespaceSpec], Sequence[bytes]]
"""The block keys to copy in a namespace (``prompt_blocks``), or None for all of it."""


def prompt_blocks(token_lists: Sequence[Sequence[int]], cache_salt: Any = None) -> BlocksOf:
    """The keys of every full block of each prompt, chained as the engines chain them, with the
    namespace's tokens per block."""
    def blocks(spec: NamespaceSpec) -> list[bytes]:
        return list(dict.fromkeys(k for t in token_lists for k in chain_keys(t, spec.tokens_per_block, cache_salt)))

    return blocks


def push(namespaces: Sequence[Namespace], client: ObjectClient, rc: RemoteConfig, auth_key: Optional[bytes],
         blocks_of: Optional[BlocksOf] = None) -> CopyReport:
    """Upload what ``namespaces`` hold locally and the remote lacks (of ``blocks_of``'s blocks only,
    when given)."""
    report, health = CopyReport(), _Health()
    up = Uploader(client, rc, auth_key, report.add, health, threads=1)
    try:
        if blocks_of is None:
            up.sync(namespaces, threads=min(rc.concurrency, 16))
        else:
            todo = []
            for ns in namespaces:
                keys = list(blocks_of(ns.spec))
                for g in ns.spec.groups:
                    todo += [(ns, g.layer_group_id, k) for k, there in zip(keys, ns.contains_many(g.layer_group_id, keys))
                             if there]
            with ThreadPoolExecutor(min(rc.concurrency, 16)) as pool:
                list(pool.map(lambda t: up.upload(*t) if health.reachable else None, todo))
    finally:
        up.close()
    report.unreachable, report.refused = health.detail, up.listing_refused
    return report


@dataclass
class RemoteNamespace:
    """A namespace found in the bucket: its spec, or why its metadata is unusable."""

    id: str
    spec: Optional[NamespaceSpec]
    damaged: Optional[str] = None
    chunks: dict[int, list[ObjectInfo]] = field(default_factory=dict)
    """Chunk objects per layer group (filled by ``inventory``)."""


Unaddressable = Optional[Callable[[str], None]]
"""Called with each key a listing leaves out (``ObjectClient.list``)."""


def namespaces(client: ObjectClient, unaddressable: Unaddressable = None) -> list[RemoteNamespace]:
    """Every namespace whose group document the bucket holds (``ns/<id>/zarr.json``).
    ``RemoteUnavailable`` when the listing, or a document's GET, gets no answer (an outage is
    not a damaged namespace)."""
    out = []
    for o in client.list("ns/", unaddressable):
        parts = o.key.split("/")
        if len(parts) != 3 or parts[2] != "zarr.json" or not NAMESPACE_ID.match(parts[1]):
            continue
        reply = client.get(o.key, timeout=max(client.rc.timeout, 5.0), max_bytes=METADATA_MAX_BYTES)
        if reply.outcome is Outcome.UNREACHABLE:
            where = "/".join(p for p in (client.rc.bucket, client.rc.prefix, o.key) if p)
            raise RemoteUnavailable(f"reading s3://{where}: unreachable: {reply.detail}")
        out.append(_parse_namespace(parts[1], reply))
    return out


def _parse_namespace(ns_id: str, reply: Reply) -> RemoteNamespace:
    if reply.outcome is not Outcome.OK:
        return RemoteNamespace(ns_id, None, f"metadata unreadable ({reply.outcome.value} {reply.detail})".strip())
    try:
        doc = json.loads(bytes(reply.data))
        spec = NamespaceSpec.from_json(doc["attributes"][NAMESPACE_ATTR])
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: JSON nested past the parser
        return RemoteNamespace(ns_id, None, f"metadata: {type(e).__name__ if isinstance(e, RecursionError) else e}")
    if spec.namespace_id != ns_id:
        return RemoteNamespace(ns_id, None, f"metadata describes namespace {spec.namespace_id}, not {ns_id}")
    return RemoteNamespace(ns_id, spec)


def inventory(client: ObjectClient, wanted: Optional[Callable[[RemoteNamespace], bool]] = None,
              unaddressable: Unaddressable = None) -> list[RemoteNamespace]:
    """The bucket's namespaces with their chunk objects per layer group. A key left out is
    handed to ``unaddressable`` once per listing that meets it (a set collects each once)."""
    found = [n for n in namespaces(client, unaddressable) if wanted is None or wanted(n)]
    for n in found:
        for o in client.list(f"ns/{n.id}/", unaddressable):
            parts = o.key.split("/")  # ns/<id>/g<gid>/c/<hi>/0/<lo>
            if (len(parts) == 7 and parts[2][:1] == "g" and _digits(parts[2][1:]) and parts[3] == "c"
                    and _digits(parts[4]) and parts[5] == "0" and _digits(parts[6])):
                n.chunks.setdefault(int(parts[2][1:]), []).append(o)
    return found


def _digits(part: str) -> bool:
    """Whether ``part`` is a decimal number as gdskv names chunks (ASCII digits: ``"²".isdigit()``
    is true, ``int("²")`` fails)."""
    return part.isascii() and part.isdigit()


def pull(store: PageStore, client: ObjectClient, auth_key: Optional[bytes],
         wanted: Optional[Callable[[RemoteNamespace], bool]] = None, blocks_of: Optional[BlocksOf] = None) -> CopyReport:
    """Fetch, verify and publish locally every remote chunk of the chosen namespaces (of
    ``blocks_of``'s blocks only, when given) that the local store lacks."""
    report, health = CopyReport(), _Health()
    skip = report.unaddressable.add
    found = inventory(client, wanted, skip) if blocks_of is None else \
        [n for n in namespaces(client, skip) if wanted is None or wanted(n)]
    for n in found:
        if n.spec is None:
            report.add(None, "damaged_namespaces")
            continue
        ns = store.namespace(n.spec)
        groups = {g.layer_group_id for g in n.spec.groups}
        if blocks_of is None:
            wanted_keys = {g: [o.key for o in objs] for g, objs in n.chunks.items()}
        else:
            keys = list(blocks_of(n.spec))
            wanted_keys = {g: [chunk_key(ns, g, k) for k in keys] for g in sorted(groups)}
        for group, rels in sorted(wanted_keys.items()):
            if group not in groups:
                report.add(ns, "skipped", len(rels))
                continue
            todo = [rel for rel in rels if not _local(ns, rel)]
            report.add(ns, "present", len(rels) - len(todo))
            coming = _among(ns, group, todo)
            for _, outcome in fetch(client, todo, ns.chunk_nbytes(group), health,
                                    lambda rel, r: _take_pulled(ns, group, rel, r, auth_key, coming)):
                report.add(ns, outcome)
    report.unreachable = health.detail
    return report


def fetch(client: ObjectClient, rels: Sequence[str], max_bytes: int, health: _Health,
          then: Callable[[str, Reply], Any]) -> Iterator[tuple[str, Any]]:
    """(rel, what ``then(rel, reply)`` returned) for each object of ``rels``, ``GET_BATCH`` at a
    time; a reply that got no answer is ``"unreachable"`` and marks ``health`` down, and from
    then on nothing more is asked (requests in flight are abandoned): every object left is
    ``"unreachable"`` too. A remote that stopped answering (hung, gone, a 503 storm) ends a pull
    or a verify after one request timeout, never one per batch. At most ``BYTES_IN_FLIGHT`` of
    objects of ``max_bytes`` are fetched at once, and no more than move within a request's
    timeout at ``SLOWEST_RATE``. Called by ``pull`` and ``verify_remote``."""
    unreachable = Outcome.UNREACHABLE.value

    def settle(batch: Sequence[str], i: int, r: Reply) -> tuple[Any]:  # in a tuple: not None, as a key not asked is
        if r.outcome is Outcome.UNREACHABLE:
            health.unreachable(None, r.detail)
            return (unreachable,)
        return (then(batch[i], r),)

    per_request = int(SLOWEST_RATE * client.request_timeout)  # what each request's own timeout lets through
    in_flight = max(1, min(client.rc.concurrency, min(BYTES_IN_FLIGHT, per_request) // max(1, max_bytes)))
    for start in range(0, len(rels), GET_BATCH):
        batch = rels[start:start + GET_BATCH]
        took = [None] * len(batch) if not health.reachable else \
            client.get_many(batch, timeout=max(BATCH_MIN_S, client.rc.timeout, len(batch) * max_bytes / SLOWEST_RATE),
                            max_bytes=max_bytes, in_flight=in_flight,
                            then=lambda i, r: settle(batch, i, r), stop=lambda: not health.reachable)
        for rel, t in zip(batch, took):
            if isinstance(t, Reply) and t.outcome is Outcome.UNREACHABLE:
                health.unreachable(None, t.detail)
            yield rel, t[0] if isinstance(t, tuple) else unreachable


def _among(ns: Namespace, group: int, rels: Sequence[str]) -> Callable[[bytes], bool]:
    """Whether a block's chunk is among ``rels`` (what a pull fetches): ``publish``'s ``coming``."""
    fetching = set(rels)
    return lambda key: chunk_key(ns, group, key) in fetching


def _local(ns: Namespace, rel: str) -> bool:
    try:
        return ns.store.fs.lstat(rel).st_size == ns.chunk_nbytes(int(rel.split("/")[2][1:]))
    except OSError:
        return False


def check_object(ns: Namespace, group: int, rel: str, data: Any, auth_key: Optional[bytes]) -> tuple[Optional[str], bytes]:
    """(None, block key) when the object at ``rel`` is a sound chunk that belongs there; else (why, b"")."""
    view = memoryview(data).cast("B")
    if view.nbytes < fmt.TRAILER_BYTES:
        return "truncated", b""
    try:
        key = fmt.unpack(view[-fmt.TRAILER_BYTES:]).block_key
    except fmt.ChunkFormatError:
        return "bad-trailer", b""
    if chunk_key(ns, group, key) != rel:
        return "foreign-key", b""
    return verify(ns, group, key, view, auth_key), key


def _take_pulled(ns: Namespace, group: int, rel: str, r: Reply, auth_key: Optional[bytes],
                 coming: Callable[[bytes], bool]) -> str:
    if r.outcome is not Outcome.OK:
        return r.outcome.value
    why, key = check_object(ns, group, rel, r.data, auth_key)
    if why is not None:
        return f"bad ({why})"
    try:
        return "pulled" if publish(ns, group, key, r.data, coming) else "dropped (budget)"
    except OSError:
        return "failed (local store)"


def verify_remote(client: ObjectClient, auth_key: Optional[bytes],
                  wanted: Optional[Callable[[RemoteNamespace], bool]] = None) -> dict[str, Any]:
    """GET and check every chunk object of the chosen namespaces; counts per reason, the bad
    ones, and the keys the listings left out (``unaddressable_keys``: not checked, not bad)."""
    counts: Counter = Counter()
    health = _Health()
    bad: list[dict[str, Any]] = []
    unaddressable: set[str] = set()
    for n in inventory(client, wanted, unaddressable.add):
        if n.spec is None:
            counts["damaged-namespace"] += sum(len(v) for v in n.chunks.values())
            bad.append({"namespace": n.id, "reason": f"damaged namespace: {n.damaged}"})
            continue
        ns = _Detached(n.spec)
        groups = {g.layer_group_id for g in n.spec.groups}
        for group, objs in sorted(n.chunks.items()):
            keys = [o.key for o in objs]
            if group not in groups:  # named like a chunk of a layer group the namespace does not have
                counts["unknown-group"] += len(keys)
                bad += [{"namespace": n.id, "group": group, "key": rel, "reason": "unknown-group"} for rel in keys]
                continue
            for rel, why in fetch(client, keys, ns.chunk_nbytes(group), health,
                                  lambda rel, r: r.outcome.value if r.outcome is not Outcome.OK
                                  else check_object(ns, group, rel, r.data, auth_key)[0]):
                counts[why or "ok"] += 1
                if why is not None:
                    bad.append({"namespace": n.id, "group": group, "key": rel, "reason": why})
    return {"checked": sum(counts.values()), "ok": counts["ok"], "bad": len(bad),
            "reasons": {k: v for k, v in counts.items() if k != "ok"}, "bad_objects": bad,
            "unaddressable": len(unaddressable), "unaddressable_keys": sorted(unaddressable),
            "unreachable": health.detail}


class _Detached(Namespace):
    """A namespace of no local store: only its keys and geometry (for checking remote objects)."""

    def __init__(self, spec: NamespaceSpec) -> None:
        self.spec = spec
        self.id = spec.namespace_id
        self._array_dirs = {g.layer_group_id: f"ns/{self.id}/g{g.layer_group_id}" for g in spec.groups}
        self._store_keys = {}
