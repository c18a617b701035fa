"""``--remote``: what ``info``, ``ls``, ``stats`` and ``verify`` show of the bucket (``[gdskv.remote]``).

Each command's ``--remote`` hands over to one function here; the listings and checks themselves
are ``gdskv.remote.copy``. Keys no client can address (``gdskv.remote.listing``) are left out and
counted (``unaddressable``), never a failure. Exit codes as everywhere: 0 ok, 1 something failed
(bad objects, the remote unreachable), 2 usage (no ``[gdskv.remote]`` in the config).
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import click
from rich.markup import escape
from rich.table import Table

from gdskv.cli._common import UsageProblem, auth_key_of, config_of, human_bytes, open_existing, print_json
from gdskv.cli.output import console
from gdskv.config import GdsKvConfig
from gdskv.remote import ObjectClient, RemoteSetupError, RemoteUnavailable
from gdskv.remote.copy import BlocksOf, RemoteNamespace, inventory, prompt_blocks, verify_remote


def remote_client(ctx: click.Context) -> tuple[GdsKvConfig, ObjectClient]:
    """The config and a client of its remote; a usage error when none is configured."""
    cfg = config_of(ctx)
    if cfg.remote is None:
        raise UsageProblem("no [gdskv.remote] table in the config (GDSKV_CONFIG); see docs/remote.md")
    try:
        return cfg, ObjectClient(cfg.remote, request_timeout=max(cfg.remote.timeout, 30.0))
    except RemoteSetupError as e:
        raise UsageProblem(str(e)) from None


def namespace_filter(wanted: Optional[str]) -> Optional[Callable[[RemoteNamespace], bool]]:
    """Namespaces whose id starts with ``wanted`` or whose model is ``wanted`` (all when None)."""
    if wanted is None:
        return None
    return lambda n: n.id.startswith(wanted) or (n.spec is not None and n.spec.model == wanted)


def prompt_options(f: Callable) -> Callable:
    """``--prompts / --tokenizer / --cache-salt`` of ``push`` and ``pull``."""
    f = click.option("--cache-salt", "cache_salt", default=None, help="The cache salt the prompts were served with.")(f)
    f = click.option("--tokenizer", default=None, help="Tokenizer of --prompts (Hugging Face id or path); default: bytes, "
                     "as the reference engine's prewarm.")(f)
    return click.option("--prompts", "prompts", multiple=True, type=click.Path(readable=False),
                        help="Only the blocks of these prompts (.txt / .jsonl / a directory, as prewarm reads them).")(f)


def prompt_blocks_of(prompts: tuple[str, ...], tokenizer: Optional[str], cache_salt: Optional[str]) -> Optional[BlocksOf]:
    """The block keys of ``prompts`` per namespace (None without ``--prompts``); a prompt that
    cannot be read or is empty is left out."""
    if not prompts:
        return None
    from gdskv.cli.prewarm import ByteTokenizer, HfTokenizer, read_prompts, tokenize

    tok = HfTokenizer.load(tokenizer) if tokenizer else ByteTokenizer()
    token_lists = []
    for p in read_prompts(prompts):
        try:
            token_lists.append(tokenize(tok, p, 1 << 30))
        except ValueError:
            continue
    return prompt_blocks(token_lists, cache_salt)


def skipped_keys(n: int) -> str:
    """What ``pull``, ``push`` and the views say of the ``n`` keys their listings left out."""
    return (f"skipped {n} key(s) no client can address (a '..', '.' or empty path segment, a control character, "
            f"a trailing '/'; gdskv never writes such keys)")


def run(ctx: click.Context, what: Callable[[GdsKvConfig, ObjectClient], None]) -> None:
    """Run one ``--remote`` view with a client, answering an unreachable remote with one line (exit 1)."""
    cfg, client = remote_client(ctx)
    try:
        what(cfg, client)
    except RemoteUnavailable as e:
        raise click.ClickException(f"remote {cfg.remote.url}: {e}") from None
    finally:
        client.close()


def _rows(found: list[RemoteNamespace]) -> list[dict[str, Any]]:
    return [{"id": n.id, "model": n.spec.model if n.spec else None, "damaged": n.damaged,
             "groups": {g: {"chunks": len(objs), "bytes": sum(o.size for o in objs)} for g, objs in sorted(n.chunks.items())}}
            for n in found]


def info(ctx: click.Context, as_json: bool) -> None:
    def show(cfg: GdsKvConfig, client: ObjectClient) -> None:
        left_out: set[str] = set()
        rows = _rows(inventory(client, unaddressable=left_out.add))
        rep = {"remote": cfg.remote.url, "endpoint": cfg.remote.endpoint, "upload": cfg.remote.upload,
               "timeout_s": cfg.remote.timeout, "namespaces": rows,
               "chunks": sum(g["chunks"] for r in rows for g in r["groups"].values()),
               "bytes": sum(g["bytes"] for r in rows for g in r["groups"].values()), "unaddressable": len(left_out)}
        if as_json:
            print_json(rep)
            return
        out = console()
        out.print(f"[bold]remote[/]  {escape(rep['remote'])}  (endpoint {escape(rep['endpoint'] or 'AWS S3')}; upload {escape(str(rep['upload']))}; "
                  f"timeout {rep['timeout_s']} s)", markup=True)
        out.print(f"[bold]size[/]    {rep['chunks']} chunks, {human_bytes(rep['bytes'])}"
                  + (f"; {escape(skipped_keys(len(left_out)))}" if left_out else ""), markup=True)
        t = Table(title="namespaces in the bucket")
        for col in ("namespace", "model", "group", "chunks", "bytes"):
            t.add_column(col, justify="right" if col in ("group", "chunks", "bytes") else "left")
        for r in rows:
            for i, (g, v) in enumerate(r["groups"].items() or [("-", {"chunks": 0, "bytes": 0})]):
                head = [r["id"], r["model"] or f"(damaged: {r['damaged']})"] if i == 0 else ["", ""]
                t.add_row(*head, str(g), str(v["chunks"]), human_bytes(v["bytes"]))
        out.print(t)

    run(ctx, show)


def ls(ctx: click.Context, namespace: Optional[str], group: Optional[int], limit: int, as_json: bool) -> None:
    def show(cfg: GdsKvConfig, client: ObjectClient) -> None:
        left_out: set[str] = set()
        objs = [(n.id, g, o) for n in inventory(client, namespace_filter(namespace), left_out.add)
                for g, lst in n.chunks.items() for o in lst if group is None or g == group]
        objs.sort(key=lambda t: -t[2].mtime)
        total = len(objs)
        rows = [{"namespace": ns_id, "group": g, "key": o.key, "bytes": o.size, "modified": o.mtime}
                for ns_id, g, o in (objs[:limit] if limit > 0 else objs)]
        if as_json:
            print_json({"total": total, "objects": rows, "unaddressable": len(left_out)})
            return
        t = Table(title=f"{len(rows)} of {total} objects in {cfg.remote.url}, most recent first")
        for col in ("namespace", "group", "object", "size", "modified"):
            t.add_column(col, justify="right" if col in ("group", "size") else "left")
        for r in rows:
            when = datetime.datetime.fromtimestamp(r["modified"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            t.add_row(r["namespace"], str(r["group"]), r["key"], human_bytes(r["bytes"]), when)
        console().print(t)
        if left_out:
            console().print(skipped_keys(len(left_out)), highlight=False)

    run(ctx, show)


def stats(ctx: click.Context, as_json: bool, summed: Callable[[Any], dict[str, Any]]) -> None:
    """The bucket's chunks per namespace, beside the local store's remote-tier counters
    (``remote_*``, summed over its processes by ``summed``; none when there is no local store)."""
    try:
        local_counters = summed(open_existing(ctx)[1])["namespaces"]
    except UsageProblem:
        local_counters = {}

    def show(cfg: GdsKvConfig, client: ObjectClient) -> None:
        left_out: set[str] = set()
        rows = _rows(inventory(client, unaddressable=left_out.add))
        rep = {"remote": cfg.remote.url, "unaddressable": len(left_out), "namespaces": {
            r["id"]: {"chunks": sum(g["chunks"] for g in r["groups"].values()),
                      "bytes": sum(g["bytes"] for g in r["groups"].values()),
                      "counters": {k: v for k, v in local_counters.get(r["id"], {}).items() if "remote" in k}}
            for r in rows}}
        if as_json:
            print_json(rep)
            return
        out = console()
        for ns_id, v in rep["namespaces"].items():
            t = Table(title=f"namespace {ns_id} in {cfg.remote.url}: {v['chunks']} chunks, {human_bytes(v['bytes'])}")
            t.add_column("counter (this store's processes)")
            t.add_column("total", justify="right")
            for k, n in sorted(v["counters"].items()):
                t.add_row(k, human_bytes(n) if k.startswith("bytes_") else str(n))
            out.print(t)
        if not rep["namespaces"]:
            out.print(f"no namespaces in {cfg.remote.url} yet")
        if left_out:
            out.print(skipped_keys(len(left_out)), highlight=False)

    run(ctx, show)


def verify(ctx: click.Context, namespace: Optional[str], as_json: bool) -> None:
    """GET and check every chunk object (trailer, key, place, size, checksum, MAC); exit 1 when any is bad."""
    bad = []

    def show(cfg: GdsKvConfig, client: ObjectClient) -> None:
        rep = verify_remote(client, auth_key_of(cfg), namespace_filter(namespace))
        bad.extend(rep["bad_objects"])
        if as_json:
            print_json(rep)
            return
        out = console()
        if rep["bad_objects"]:
            t = Table(title="bad objects (a read-through treats each as a miss)")
            for col in ("namespace", "group", "reason", "object"):
                t.add_column(col)
            for b in rep["bad_objects"]:
                t.add_row(str(b["namespace"]), str(b.get("group", "")), str(b["reason"]), str(b.get("key", "")))
            out.print(t)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(rep["reasons"].items()))
        out.print(f"checked {rep['checked']} objects in {cfg.remote.url}: {rep['ok']} ok, {rep['bad']} bad"
                  + (f" ({reasons})" if reasons else "")
                  + (f"; {skipped_keys(rep['unaddressable'])}" if rep["unaddressable"] else "")
                  + (f"; remote unreachable: {rep['unreachable']}" if rep["unreachable"] else ""))

    run(ctx, show)
    if bad:
        ctx.exit(1)
