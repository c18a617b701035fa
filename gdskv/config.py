"""gdskv's configuration: one dataclass, loaded from TOML.

Where it comes from, in order: the defaults below; the TOML file named by ``GDSKV_CONFIG`` (or the
``path`` argument); ``GDSKV_STORE`` for the store path; keyword overrides. Loaded once at bring-up
by every connector, the CLI and the demo. Unknown keys and bad values raise ``ConfigError``
naming the key, so a typo fails at start-up rather than silently using a default.
"""
from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ENV_CONFIG = "GDSKV_CONFIG"
ENV_STORE = "GDSKV_STORE"
ENGINES = ("auto", "posix", "kvikio")
O_DIRECT_MODES = ("off", "writes", "all")


class ConfigError(ValueError):
    """A setting is unknown or has a bad value; the message names the setting."""


def default_store_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gdskv", "store")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str | int) -> int:
    """``"500G"`` → bytes (binary units: K = 1024). Integers pass through."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 512M, 500G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass
class GdsKvConfig:
    """All settings. Sizes accept ints or strings like ``"500G"`` in TOML."""

    store_path: str = field(default_factory=default_store_path)
    engine: str = "auto"
    io_threads: int = 8
    o_direct: str = "all"
    fsync: bool = False
    kvikio_threads: int = 4
    kvikio_task_size: int = 4 << 20
    max_bytes: Optional[int] = None
    min_free_bytes: Optional[int] = None
    min_free_percent: Optional[float] = None
    model_id: Optional[str] = None
    stats_flush_seconds: float = 5.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"gdskv config: {key} {why}")

        if not isinstance(self.store_path, str) or not self.store_path:
            raise bad("store_path", "must be a non-empty path")
        if self.engine not in ENGINES:
            raise bad("engine", f"must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        for key in ("io_threads", "kvikio_threads"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 256:
                raise bad(key, f"must be an integer in [1, 256], got {v!r}")
        if isinstance(self.o_direct, bool):
            self.o_direct = "all" if self.o_direct else "off"
        if self.o_direct not in O_DIRECT_MODES:
            raise bad("o_direct", f"must be one of {', '.join(O_DIRECT_MODES)} (or true/false), got {self.o_direct!r}")
        if not isinstance(self.fsync, bool):
            raise bad("fsync", f"must be true or false, got {self.fsync!r}")
        for key in ("kvikio_task_size", "max_bytes", "min_free_bytes"):
            v = getattr(self, key)
            if v is None:
                continue
            try:
                setattr(self, key, parse_size(v))
            except (ValueError, TypeError) as e:
                raise bad(key, str(e)) from None
        if self.kvikio_task_size < 4096:
            raise bad("kvikio_task_size", "must be at least 4096 bytes")
        p = self.min_free_percent
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 100):
            raise bad("min_free_percent", f"must be a number in [0, 100), got {p!r}")
        if not isinstance(self.stats_flush_seconds, (int, float)) or self.stats_flush_seconds <= 0:
            raise bad("stats_flush_seconds", "must be a positive number")


_FIELDS = {f.name for f in dataclasses.fields(GdsKvConfig)}


def load_config(path: Optional[str] = None, **overrides: Any) -> GdsKvConfig:
    """Build the config (see the module docstring for precedence)."""
    values: dict[str, Any] = {}
    path = path or os.environ.get(ENV_CONFIG)
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"gdskv config: file {path} (from {ENV_CONFIG}) does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"gdskv config: {path} is not valid TOML: {e}") from None
        data = data.get("gdskv", data)
        for key, value in data.items():
            if key not in _FIELDS:
                raise ConfigError(f"gdskv config: unknown setting {key!r} in {path} (known: {', '.join(sorted(_FIELDS))})")
            values[key] = value
    if os.environ.get(ENV_STORE):
        values["store_path"] = os.environ[ENV_STORE]
    for key, value in overrides.items():
        if key not in _FIELDS:
            raise ConfigError(f"gdskv config: unknown setting {key!r}")
        if value is not None:
            values[key] = value
    if "store_path" in values:
        values["store_path"] = os.path.expanduser(str(values["store_path"]))
    return GdsKvConfig(**values)
