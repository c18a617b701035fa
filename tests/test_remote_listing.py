"""Keys in a shared bucket that obstore cannot name (a ``..``, ``.`` or empty segment, a control
character, a trailing ``/``): every listing goes on past them, leaves them out and counts them,
against moto's S3 server. Before, one such key failed obstore's whole listing, so ``pull``, the
``--remote`` views, ``verify --remote`` and the uploader's leftovers all stopped on it."""
from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from click.testing import CliRunner

from gdskv.cli.main import main
from gdskv.config import GdsKvConfig, RemoteConfig
from gdskv.keys import chain_keys
from gdskv.remote import ObjectClient
from gdskv.remote.objects import chunk_key
from gdskv.service import KvService
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from remote_helpers import BUCKET, MotoEndpoint, free_port, remote_table, save_chain, wait_for

pytestmark = pytest.mark.usefixtures("aws_credentials")

SPEC = NamespaceSpec("remote-listing", "float16", 4, (GroupSpec(0, 2048, (0,)),))
KEYS = chain_keys(list(range(6 * 4 + 1)), 4)


def client_of(endpoint: MotoEndpoint, prefix: str) -> ObjectClient:
    return ObjectClient(RemoteConfig(**remote_table(endpoint.url, prefix)))


def hostile_keys(ns_id: str) -> list[str]:
    """Keys (relative to the prefix) anyone with write access can put: inside the namespace's
    own tree (a ``..`` that would climb out of the store, an empty segment, a ``.``, a control
    character, a chunk-shaped name with a trailing ``/``), and beside the namespaces."""
    return [f"ns/{ns_id}/g0/c/0/0/../../../../../../escape", f"ns/{ns_id}//g0", f"ns/{ns_id}/./zarr.json",
            f"ns/{ns_id}/g0/c/1/0/\x01", f"ns/{ns_id}/g0/c/0/0/1/", "ns/../escape", "ns//zarr.json"]


def put_keys(endpoint: MotoEndpoint, prefix: str, keys: list[str], body: bytes = b"x") -> None:
    for k in keys:
        endpoint.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{k}", Body=body)


NAMES = ["a/b", "a/..", "a/../b", "a/.", "a/./b", "a//b", "/a", "a/b/", "a/\x01", "a/b\x7f", "a/\t", "a/...",
         "a/%2e%2e", "a/b\\c", "a/sp ace+&=?", "a/\u00fc\u2028"]


@pytest.mark.parametrize("rel", NAMES)
def test_addressable_is_what_obstore_lists_as_it_is(endpoint, rel):
    """``addressable`` is obstore's own rule: a key is listed, as itself, exactly when it holds."""
    import obstore

    from gdskv.remote.listing import addressable

    prefix = f"addr{NAMES.index(rel)}"
    endpoint.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=b"x")
    client = client_of(endpoint, prefix)
    try:
        listed = [str(m["path"]) for batch in obstore.list(client.store, None) for m in batch]
    except obstore.exceptions.InvalidPathError:
        listed = []
    finally:
        client.close()
    assert addressable(rel) == (listed == [rel])


def test_a_listing_goes_on_past_keys_obstore_cannot_name_from_the_last_key_it_had(endpoint):
    """1001 objects: obstore's first page of 1000 lists, its second (holding ``k1000/../x``)
    fails, and the listing goes on after ``k0999``; the whole ``ns/`` listing fails on its first
    page (``ns/a//b``) and the raw listing takes both pages itself. Every object once, in order."""
    from obstore.store import S3Store

    prefix = "many"
    names = [f"ns/x/k{i:04d}" for i in range(1001)]
    store = S3Store(BUCKET, prefix=prefix, config={"endpoint": endpoint.url, "region": "us-east-1"},
                    client_options={"allow_http": True})

    async def put_all() -> None:
        import obstore

        limit = asyncio.Semaphore(32)

        async def one(rel: str) -> None:
            async with limit:
                await obstore.put_async(store, rel, b"")

        await asyncio.gather(*(one(rel) for rel in names))

    asyncio.run(put_all())
    put_keys(endpoint, prefix, ["ns/x/k1000/../x", "ns/a//b"])
    endpoint.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ns/xy", Body=b"x")  # not under ns/x/
    client = client_of(endpoint, prefix)
    try:
        assert [o.key for o in client.list("ns/x/")] == names
        left_out: list[str] = []
        assert [o.key for o in client.list("ns/x/", left_out.append)] == names
        assert left_out == ["ns/x/k1000/../x"]
        left_out.clear()
        listed = [o for o in client.list("ns/", left_out.append)]
        assert [o.key for o in listed] == names + ["ns/xy"]
        assert left_out == ["ns/a//b", "ns/x/k1000/../x"]
        assert listed[-1].size == 1 and listed[0].mtime > 0
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["keys", "session", "profile"])
def test_the_listing_past_such_keys_is_signed_as_s3_checks_it(tmp_path, endpoint, monkeypatch, kind):
    """With moto checking every request's signature (as botocore computes it) against an IAM
    user's key: the listing gdskv signs itself passes, with an access key in the environment, with
    a session token (STS), and with a profile read through boto3 (the credential provider)."""
    import urllib.request

    import boto3

    def aws(service: str, key_id: str = "testing", secret: str = "testing"):
        return boto3.client(service, endpoint_url=endpoint.url, region_name="us-east-1", aws_access_key_id=key_id,
                            aws_secret_access_key=secret)

    iam, user = aws("iam"), f"lister-{kind}"
    allow_s3 = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})
    arn = iam.create_user(UserName=user)["User"]["Arn"]
    iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=allow_s3)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    creds = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    if kind == "session":  # a role's temporary credentials: a session token signed along
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"AWS": arn},
                                                         "Action": "sts:AssumeRole"}]}
        role = iam.create_role(RoleName=user, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
        iam.put_role_policy(RoleName=user, PolicyName="s3", PolicyDocument=allow_s3)
        temp = aws("sts", key["AccessKeyId"], key["SecretAccessKey"]).assume_role(RoleArn=role, RoleSessionName="lister")
        creds = {"AWS_ACCESS_KEY_ID": temp["Credentials"]["AccessKeyId"],
                 "AWS_SECRET_ACCESS_KEY": temp["Credentials"]["SecretAccessKey"],
                 "AWS_SESSION_TOKEN": temp["Credentials"]["SessionToken"]}
    if kind == "profile":
        (tmp_path / "credentials").write_text(f"[lister]\naws_access_key_id = {key['AccessKeyId']}\n"
                                              f"aws_secret_access_key = {key['SecretAccessKey']}\n")
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(k)
        creds = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "config"),
                 "AWS_PROFILE": "lister"}
    prefix = f"signed-{kind}"
    put_keys(endpoint, prefix, ["ns/a/../b", "ns/a//c"])
    put_keys(endpoint, prefix, ["ns/a/b", "ns/a/c (1)+%", "ns/\u00fc"])
    for k, v in creds.items():
        monkeypatch.setenv(k, v)

    def enforce(after: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint.url}/moto-api/reset-auth", data=after.encode(),
                                                      headers={"Content-Type": "text/plain"})).close()

    client = client_of(endpoint, prefix)
    enforce("0")
    try:
        assert [o.key for o in client.list("ns/")] == ["ns/a/b", "ns/a/c (1)+%", "ns/\u00fc"]
        left_out: list[str] = []
        assert [o.key for o in client.list("ns/", left_out.append)] == ["ns/a/b", "ns/a/c (1)+%", "ns/\u00fc"]
        assert left_out == ["ns/a/../b", "ns/a//c"]
    finally:
        enforce("inf")
        client.close()


def test_leftovers_go_up_past_keys_obstore_cannot_name(tmp_path, endpoint, caplog):
    """A node's leftover upload lists its namespace in the bucket: with hostile keys there it
    uploaded nothing (the listing was refused); now it uploads every chunk and counts the keys."""
    prefix = "leftovers"
    down = f"http://127.0.0.1:{free_port()}"
    a = KvService(GdsKvConfig(store_path=str(tmp_path / "a"), remote=remote_table(down, prefix, drain="100ms")), SPEC)
    save_chain(a, KEYS, 7)
    ns_id = a.namespace.id
    put_keys(endpoint, prefix, hostile_keys(ns_id))
    with caplog.at_level(logging.WARNING, logger="gdskv.remote.upload"):
        again = KvService(GdsKvConfig(store_path=str(tmp_path / "a"), remote=remote_table(endpoint.url, prefix)), SPEC)
        chunk = re.compile(rf"{prefix}/ns/{ns_id}/g0/c/\d+/0/\d+")
        assert wait_for(lambda: len([k for k in endpoint.keys(f"{prefix}/") if chunk.fullmatch(k)]) == len(KEYS), 20)
        again.close()
    in_namespace = [k for k in hostile_keys(ns_id) if k.startswith(f"ns/{ns_id}/")]
    assert again.namespace.counters["remote_unaddressable_keys"] == len(in_namespace)
    assert again.namespace.counters["remote_leftovers_uploaded"] == len(KEYS)
    assert "no client can address" in caplog.text


# --- the command line -------------------------------------------------------------------------------

def gdskv(store, *args: str):
    return CliRunner().invoke(main, ["--store", str(store), *args], catch_exceptions=False)


def test_pull_and_the_remote_views_skip_and_count_keys_obstore_cannot_name(tmp_path, endpoint, monkeypatch):
    """``pull`` brings every chunk and writes nothing outside its store (a ``..`` key never
    becomes a path); ``info``/``ls``/``stats``/``verify --remote`` and ``push`` answer as for a
    clean bucket, with the keys left out counted. Before, each ended with "listing ... refused"."""
    prefix = f"cli-{tmp_path.name}"
    config = tmp_path / "gdskv.toml"
    config.write_text(f'[gdskv]\n[gdskv.remote]\nurl = "s3://{BUCKET}/{prefix}"\nendpoint = "{endpoint.url}"\n'
                      f'upload = "off"\n')
    monkeypatch.setenv("GDSKV_CONFIG", str(config))
    a = KvService(GdsKvConfig(store_path=str(tmp_path / "a")), SPEC)
    save_chain(a, KEYS, 8)
    assert gdskv(tmp_path / "a", "push").exit_code == 0
    ns_id = a.namespace.id
    real = endpoint.s3.get_object(Bucket=BUCKET, Key=f"{prefix}/{chunk_key(a.namespace, 0, KEYS[0])}")["Body"].read()
    hostile = hostile_keys(ns_id)
    put_keys(endpoint, prefix, hostile, body=real)  # a sound chunk's bytes, should anything fetch them

    r = gdskv(tmp_path / "b", "pull", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["counts"] == {"pulled": len(KEYS), "present": 0} and rep["unaddressable"] == len(hostile)
    (ns,) = PageStore.open(tmp_path / "b", create=False).namespaces()
    assert ns.contains_many(0, KEYS) == [True] * len(KEYS)
    assert [p for p in tmp_path.rglob("*") if "escape" in p.name] == []
    assert gdskv(tmp_path / "b", "verify").exit_code == 0
    r = gdskv(tmp_path / "c", "pull")
    assert r.exit_code == 0 and f"pulled {len(KEYS)} chunk(s)" in r.output and f"skipped {len(hostile)} key(s)" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output

    info = json.loads(gdskv(tmp_path / "a", "info", "--remote", "--json").output)
    assert info["chunks"] == len(KEYS) and info["unaddressable"] == len(hostile)
    ls = json.loads(gdskv(tmp_path / "a", "ls", "--remote", "--json").output)
    assert ls["total"] == len(KEYS) and ls["unaddressable"] == len(hostile)
    stats = json.loads(gdskv(tmp_path / "a", "stats", "--remote", "--json").output)
    assert stats["namespaces"][ns_id]["chunks"] == len(KEYS) and stats["unaddressable"] == len(hostile)
    for view in ("info", "ls", "stats"):
        r = gdskv(tmp_path / "a", view, "--remote")
        assert r.exit_code == 0 and f"skipped {len(hostile)} key(s)" in r.output, (view, r.output)

    r = gdskv(tmp_path / "a", "verify", "--remote", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["ok"] == rep["checked"] == len(KEYS) and rep["bad"] == 0
    assert rep["unaddressable_keys"] == sorted(hostile)
    r = gdskv(tmp_path / "a", "verify", "--remote")
    assert r.exit_code == 0 and f"{len(KEYS)} ok, 0 bad; skipped {len(hostile)} key(s)" in r.output

    r = gdskv(tmp_path / "a", "push", "--json")
    assert r.exit_code == 0, r.output
    pushed = json.loads(r.output)
    assert pushed["uploaded"] == 0
    assert pushed["unaddressable"] == len([k for k in hostile if k.startswith(f"ns/{ns_id}/")])
