"""Shared fixtures. Every test gets its own default store location, so nothing touches ~/.cache."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_default_store(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv("GDSKV_STORE", raising=False)
    monkeypatch.delenv("GDSKV_CONFIG", raising=False)


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "store")
