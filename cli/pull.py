"""``gdskv pull [--namespace NS] [--prompts FILE...]``: fetch the remote's chunks that the local store lacks.

With ``--prompts`` (and the ``--tokenizer`` / ``--cache-salt`` they were served with), only the
blocks of those prompts come down: a node warms itself for a known workload.

Each object is verified exactly as a read-through verifies it (trailer, layer group, store and
block key, its place in the array, size, checksum, MAC where a chunk key is configured) before it
is published into the local store atomically; a bad object is counted and left out. Namespaces
come from the bucket's ``zarr.json`` documents (created locally when new). Keys no client can
address are left out of the listings and counted (``unaddressable``: not gdskv's, so no failure).
Once a request gets no answer (the remote hung, gone, in a 503 storm), nothing more is asked: the
rest count ``unreachable`` and the line says why. Exit codes: 0 pulled, 1 bad objects or failures
(the remote unreachable included), 2 usage (no ``[gdskv.remote]``).
"""
from __future__ import annotations

from typing import Optional

import click

from gdskv.cli._common import auth_key_of, config_of, print_json, store_refused
from gdskv.cli._remote import namespace_filter, prompt_blocks_of, prompt_options, remote_client, skipped_keys
from gdskv.cli.output import console
from gdskv.eviction import install_budget
from gdskv.remote import RemoteUnavailable
from gdskv.remote.copy import pull as pull_namespaces
from gdskv.store import PageStore, StoreError


@click.command()
@click.option("--namespace", "namespace", default=None, help="Namespace id (or a prefix of it) or model name; default all.")
@prompt_options
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
def pull(ctx: click.Context, namespace: Optional[str], prompts: tuple[str, ...], tokenizer: Optional[str],
         cache_salt: Optional[str], as_json: bool) -> None:
    """Download remote chunks the local store lacks (verified, published atomically)."""
    cfg = config_of(ctx)
    blocks_of = prompt_blocks_of(prompts, tokenizer, cache_salt)  # a usage error here creates no store
    _, client = remote_client(ctx)  # nor does a config without [gdskv.remote]
    try:
        try:
            store = PageStore.from_config(cfg)  # like prewarm, pull may make the store
        except (StoreError, OSError) as e:
            raise store_refused(str(e)) from None
        install_budget(store, cfg)  # pulled chunks are admitted, and room made, as a server's saves are
        rep = pull_namespaces(store, client, auth_key_of(cfg), namespace_filter(namespace), blocks_of)
    except RemoteUnavailable as e:
        raise click.ClickException(f"pull: remote {cfg.remote.url}: {e}") from None
    finally:
        client.close()
    store.flush_stats()
    counts = dict(sorted(rep.counts.items()))
    failed = sum(v for k, v in counts.items() if k not in ("pulled", "present"))
    if as_json:
        print_json({"remote": cfg.remote.url, "store": str(store.root), "counts": counts,
                    "unaddressable": len(rep.unaddressable), "unreachable": rep.unreachable or None})
    else:
        console().print(f"pulled {counts.get('pulled', 0)} chunk(s) from {cfg.remote.url} into {store.root}; "
                        f"{counts.get('present', 0)} already here"
                        + "".join(f", {v} {k}" for k, v in counts.items() if k not in ("pulled", "present"))
                        + (f"; {skipped_keys(len(rep.unaddressable))}" if rep.unaddressable else "")
                        + (f"; remote unreachable: {rep.unreachable}" if rep.unreachable else ""), highlight=False)
    if failed:
        ctx.exit(1)
