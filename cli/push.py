"""``gdskv push [--namespace NS] [--prompts FILE...]``: upload the local store's chunks that the remote lacks.

With ``--prompts`` (and the ``--tokenizer`` / ``--cache-salt`` they were served with), only the
blocks of those prompts go up.

Create-only (``If-None-Match: *``): an object already in the bucket is never replaced. Every chunk
is verified before it goes up (a chunk damaged on local disk stays here), and its namespace's
``zarr.json`` documents go first, so the bucket is a Zarr hierarchy stock zarr opens. Exit codes:
0 pushed, 1 the remote was unreachable or refused uploads, 2 usage (no store, no
``[gdskv.remote]``).
"""
from __future__ import annotations

from typing import Optional

import click

from gdskv.cli._common import auth_key_of, open_existing, print_json, select_namespaces
from gdskv.cli._remote import prompt_blocks_of, prompt_options, remote_client, skipped_keys
from gdskv.cli.output import console
from gdskv.remote.copy import BlocksOf
from gdskv.remote.copy import push as push_namespaces


def push_namespaces_of(ctx: click.Context, namespaces: list, blocks_of: Optional[BlocksOf] = None) -> tuple[dict, bool, str]:
    """Push ``namespaces`` (only ``blocks_of``'s blocks, when given): (counts for ``--json``,
    whether everything went up, one line for people). Also called by ``gdskv prewarm --remote``."""
    cfg, client = remote_client(ctx)
    try:
        rep = push_namespaces(namespaces, client, cfg.remote, auth_key_of(cfg), blocks_of)
    finally:
        client.close()
    c = rep.counts
    out = {"remote": cfg.remote.url, "namespaces": [ns.id for ns in namespaces], "uploaded": c["remote_uploaded"],
           "already_there": c["remote_upload_exists"], "skipped": c["remote_upload_skipped"],
           "refused": c["remote_upload_refused"], "failed": c["remote_upload_failed"], "unreachable": rep.unreachable or None,
           "refused_listing": rep.refused or None, "unaddressable": c["remote_unaddressable_keys"]}
    line = (f"pushed {out['uploaded']} chunk(s) of {len(namespaces)} namespace(s) to {out['remote']}; "
            f"{out['already_there']} already there, {out['skipped']} skipped (gone or unsound locally)"
            + (f", {out['refused']} refused" if out["refused"] else "")
            + (f"; {skipped_keys(out['unaddressable'])}" if out["unaddressable"] else "")
            + (f"; remote unreachable: {rep.unreachable}" if rep.unreachable else "")
            + (f"; the remote refused: {rep.refused}" if rep.refused else ""))
    return out, not (rep.unreachable or rep.refused or out["refused"] or out["failed"]), line


@click.command()
@click.option("--namespace", "namespace", default=None, help="Namespace id (or a prefix of it) or model name; default all.")
@prompt_options
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
def push(ctx: click.Context, namespace: Optional[str], prompts: tuple[str, ...], tokenizer: Optional[str],
         cache_salt: Optional[str], as_json: bool) -> None:
    """Upload local chunks the remote lacks (create-only, verified first)."""
    _, store = open_existing(ctx)
    chosen = select_namespaces(store, namespace)
    out, ok, line = push_namespaces_of(ctx, [store.namespace(ns.spec) for ns in chosen],
                                       prompt_blocks_of(prompts, tokenizer, cache_salt))
    if as_json:
        print_json(out)
    else:
        console().print(line, highlight=False)
    if not ok:
        ctx.exit(1)
