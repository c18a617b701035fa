"""Shared fixtures. Every test gets its own default store location, so nothing touches ~/.cache.
The files that run real engines are collected first (see ``pytest_collection_modifyitems``)."""
from __future__ import annotations

import pytest

ENGINE_MARKS = ("max", "vllm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the files that run real engines (minutes each) to the front, whole and in their own
    order, so that with several workers (``-n``, ``--dist loadfile``) they start first and the
    short files fill in around them instead of one engine file starting last."""
    def engine_file(item: pytest.Item) -> bool:
        return any(item.get_closest_marker(m) for m in ENGINE_MARKS)

    engine_files = {item.path for item in items if engine_file(item)}
    items.sort(key=lambda item: item.path not in engine_files)


@pytest.fixture(autouse=True)
def _isolated_default_store(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv("GDSKV_STORE", raising=False)
    monkeypatch.delenv("GDSKV_CONFIG", raising=False)


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture(scope="module")
def endpoint():
    """A moto S3 server for one test file (``remote_helpers.MotoEndpoint``)."""
    from remote_helpers import MotoEndpoint

    ep = MotoEndpoint()
    yield ep
    ep.stop()


@pytest.fixture
def aws_credentials(monkeypatch):
    """The moto server's credentials in the environment, where the S3 client looks for them."""
    from remote_helpers import CREDENTIALS

    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
