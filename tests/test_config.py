"""Configuration: TOML, environment, and errors that name the setting."""
from __future__ import annotations

import pytest

from gdskv.config import ConfigError, load_config, parse_size


def test_defaults_live_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_config().store_path == str(tmp_path / "gdskv" / "store")


def test_toml_then_env_store_override(tmp_path, monkeypatch):
    cfg_file = tmp_path / "g.toml"
    cfg_file.write_text('[gdskv]\nstore_path = "/from/toml"\nengine = "posix"\nmax_bytes = "2G"\nmin_free_percent = 5\n')
    monkeypatch.setenv("GDSKV_CONFIG", str(cfg_file))
    cfg = load_config()
    assert (cfg.store_path, cfg.engine, cfg.max_bytes, cfg.min_free_percent) == ("/from/toml", "posix", 2 << 30, 5)
    monkeypatch.setenv("GDSKV_STORE", str(tmp_path / "env-store"))
    assert load_config().store_path == str(tmp_path / "env-store")


@pytest.mark.parametrize(
    "body, setting",
    [
        ("stor_path = 'x'", "stor_path"),
        ("engine = 'gds'", "engine"),
        ("io_threads = 0", "io_threads"),
        ("max_bytes = 'lots'", "max_bytes"),
        ("o_direct = 'yes'", "o_direct"),
        ("min_free_percent = 150", "min_free_percent"),
    ],
)
def test_bad_settings_fail_naming_the_setting(tmp_path, body, setting):
    f = tmp_path / "bad.toml"
    f.write_text(body + "\n")
    with pytest.raises(ConfigError, match=setting):
        load_config(str(f))


def test_missing_file_and_bad_toml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    (tmp_path / "x.toml").write_text("engine = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(tmp_path / "x.toml"))


def test_the_shipped_example_config_loads():
    import pathlib

    example = pathlib.Path(__file__).parent.parent / "config" / "gdskv.toml"
    cfg = load_config(str(example))
    assert cfg.engine in ("auto", "posix", "kvikio")


def test_parse_size():
    assert parse_size("4096") == 4096 and parse_size("1.5K") == 1536 and parse_size("500G") == 500 << 30
    assert parse_size("2GiB") == 2 << 30 and parse_size(7) == 7
    with pytest.raises(ValueError):
        parse_size("ten")
