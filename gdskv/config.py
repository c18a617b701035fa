"""gdskv's configuration: one dataclass, loaded from TOML.

Where it comes from, in order: the defaults below; the TOML file named by ``GDSKV_CONFIG`` (or the
``path`` argument); ``GDSKV_STORE`` for the store path; keyword overrides. Loaded once at bring-up
by every connector, the CLI and the demo. Unknown keys and bad values raise ``ConfigError``
naming the key, so a typo fails at start-up rather than silently using a default.

The TOML holds the settings in a ``[gdskv]`` table, or (a file for gdskv alone) at its top level;
with a ``[gdskv]`` table nothing else may stand at the top level (it would be silently ignored).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

ENV_CONFIG = "GDSKV_CONFIG"
ENV_STORE = "GDSKV_STORE"
ENGINES = ("auto", "posix", "kvikio")
O_DIRECT_MODES = ("off", "writes", "all")
UPLOAD_MODES = ("behind", "through", "off")
MIN_AUTH_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 1 << 16
"""The largest ``auth_key_file`` read (a key is tens of bytes; a bigger file is a mistake)."""
MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read."""
DEFAULT_FILE_MODE = 0o600
DEFAULT_ASYNC_LOAD_MIN_BYTES = 16 << 20
"""See ``GdsKvConfig.async_load_min_bytes`` and docs/trtllm.md (where the line is, and why)."""


class ConfigError(ValueError):
    """A setting is unknown or has a bad value; the message names the setting."""


def default_store_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gdskv", "store")


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGTP])(?:i?B)?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str | int) -> int:
    """``"500G"`` → bytes (binary units: K = 1024). Integers pass through; a float or a decimal
    string must come to a whole number of bytes (``"1.5K"`` is 1536, ``1.5`` is refused)."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 512M, 500G)")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    if isinstance(text, float):
        if not math.isfinite(text) or not text.is_integer() or text < 0:
            raise ValueError(f"not a whole, non-negative number of bytes: {text!r}")
        return int(text)
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 512M, 500G)")
    value = Decimal(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    if value != value.to_integral_value():
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


_OCTAL_RE = re.compile(r"^(?:0o)?([0-7]{1,4})$", re.IGNORECASE)


def parse_file_mode(value: int | str) -> int:
    """``file_mode``: an int (``0o640`` in TOML) or an octal string (``"0640"``, ``"640"``,
    ``"0o640"``). Only read/write permission bits, and the owner must be able to read and write."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"must be an octal mode like \"0600\" or 0o600, got {value!r}")
    if isinstance(value, str):
        m = _OCTAL_RE.match(value.strip())
        if not m:
            raise ValueError(f"must be an octal mode like \"0600\" or 0o600, got {value!r}")
        mode = int(m.group(1), 8)
    else:
        mode = value
    if mode < 0 or mode & ~0o666:
        raise ValueError(f"may hold only read and write bits (no execute, setuid, setgid or sticky bits), got {mode:#o}"
                         + (" (a decimal TOML integer? write 0o640 or \"0640\")" if isinstance(value, int) else ""))
    if mode & 0o600 != 0o600:
        raise ValueError(f"must give the owner read and write (0o600), got {mode:#o}")
    return mode


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0}


MAX_SECONDS = 7 * 86400.0
"""The longest duration a setting takes (a week): longer ones are mistakes, and overflow the
timers that wait them."""


def parse_seconds(value: str | int | float) -> float:
    """``"2s"`` / ``"500ms"`` / ``"1m"`` / a number of seconds → seconds (from 1 ms to a week)."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r} (expected e.g. 2s, 500ms)")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(value) if isinstance(value, str) else None
        if not m:
            raise ValueError(f"not a duration: {value!r} (expected e.g. 2s, 500ms)")
        seconds = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "s").lower()]
    if not math.isfinite(seconds) or not 1e-3 <= seconds <= MAX_SECONDS:
        raise ValueError(f"must be a duration from 1ms to a week, got {value!r}")
    return seconds


def _endpoint_ok(endpoint: Any) -> bool:
    """Whether ``endpoint`` is an http(s) URL the S3 client can use: a host, a valid port."""
    if not isinstance(endpoint, str) or not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", endpoint):
        return False
    parts = urllib.parse.urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        return False
    # credentials in the URL (user:secret@host) would be logged with it; they go in the environment
    return bool(parts.hostname) and (port is None or port >= 1) and "@" not in parts.netloc


_CREDENTIAL_WORDS = ("key", "secret", "token", "password", "credential")


@dataclass
class RemoteConfig:
    """``[gdskv.remote]``: the shared tier on S3-compatible object storage (``gdskv.remote``).
    Credentials never stand here: they come from the standard AWS environment variables
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``) or profiles."""

    url: str = ""
    """``s3://bucket`` or ``s3://bucket/prefix``: where the store's Zarr layout lives remotely."""
    endpoint: Optional[str] = None
    """``http(s)://host:port`` for MinIO, Ceph RGW, a local test server; None for AWS S3."""
    region: Optional[str] = None
    upload: str = "behind"
    """``behind`` (a bounded queue after each local publish), ``through`` (a save resolves once
    uploaded), ``off`` (read-only)."""
    timeout: float = 2.0
    """Seconds a lookup may spend on the remote (``"2s"``, ``"500ms"`` in TOML)."""
    concurrency: int = 16
    """Requests in flight at once (reads and uploads each)."""
    queue: int = 4096
    """Uploads waiting at most; beyond it a save is not queued (it is uploaded at the next start)."""
    negative_ttl: float = 5.0
    """Seconds a remote miss is remembered before the remote is asked about that key again."""
    retry_after: float = 30.0
    """Seconds an unreachable remote is left alone before it is tried again."""
    drain: float = 10.0
    """Seconds ``close`` waits for queued uploads (the rest go at the next start)."""

    @classmethod
    def from_toml(cls, table: Any) -> "RemoteConfig":
        """The ``[gdskv.remote]`` table; ``ConfigError`` naming ``remote.<key>`` otherwise."""
        if isinstance(table, RemoteConfig):
            table.__post_init__()  # a table changed since it was made is checked again
            return table
        if not isinstance(table, dict):
            raise ConfigError(f"gdskv config: remote must be a table ([gdskv.remote]), got {type(table).__name__} {table!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in table:
            if key not in known:
                if any(w in str(key).lower() for w in _CREDENTIAL_WORDS):
                    raise ConfigError(f"gdskv config: remote.{key}: credentials never go in gdskv's config; set "
                                      f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile) in the environment")
                raise ConfigError(f"gdskv config: unknown setting remote.{key} (known: {', '.join(sorted(known))})")
        return cls(**table)

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"gdskv config: remote.{key} {why}")

        if (not isinstance(self.url, str) or not re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^\s]*)?", self.url)
                or ".." in self.bucket or re.fullmatch(r"[0-9.]+", self.bucket)):
            raise bad("url", f"must be s3://bucket or s3://bucket/prefix (a valid bucket name), got {self.url!r}")
        if self.endpoint is not None and not _endpoint_ok(self.endpoint):
            shown = re.sub(r"//[^/@]*@", "//***@", self.endpoint) if isinstance(self.endpoint, str) else self.endpoint
            raise bad("endpoint", f"must be an http:// or https:// URL with a host (and a port in [1, 65535]) and no "
                                  f"credentials (they go in the environment), got {shown!r}")
        if self.region is not None and (not isinstance(self.region, str) or not re.fullmatch(r"[a-z0-9\-]+", self.region)):
            raise bad("region", f"must be a region name like us-east-1, got {self.region!r}")
        if self.upload not in UPLOAD_MODES:
            raise bad("upload", f"must be one of {', '.join(UPLOAD_MODES)}, got {self.upload!r}")
        for key in ("timeout", "negative_ttl", "retry_after", "drain"):
            try:
                setattr(self, key, parse_seconds(getattr(self, key)))
            except ValueError as e:
                raise bad(key, str(e)) from None
        for key, hi in (("concurrency", 256), ("queue", 1 << 20)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                raise bad(key, f"must be an integer in [1, {hi}], got {v!r}")

    @property
    def bucket(self) -> str:
        return self.url[len("s3://"):].partition("/")[0]

    @property
    def prefix(self) -> str:
        """The key prefix inside the bucket, without slashes at either end ("" for the bucket's root)."""
        return self.url[len("s3://"):].partition("/")[2].strip("/")


def _decode_key(data: bytes) -> bytes:
    """A secret key as configured: surrounding whitespace stripped; a value made only of hex
    digits (an even number of them) is decoded from hex; anything else is the raw bytes."""
    text = data.strip()
    if text and len(text) % 2 == 0 and re.fullmatch(rb"[0-9a-fA-F]+", text):
        return bytes.fromhex(text.decode("ascii"))
    return text


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass
class GdsKvConfig:
    """All settings. Sizes accept ints or strings like ``"500G"`` in TOML."""

    store_path: str = field(default_factory=default_store_path)
    engine: str = "auto"
    io_threads: int = 16
    """Pages in flight per transfer (the depth): 16 measured 1.3-1.5x faster cold loads of 256 KiB
    pages than 8 on the development VM's disk, and no slower at 1-4 MiB."""
    o_direct: str = "all"
    fsync: bool = False
    kvikio_threads: int = 4
    kvikio_task_size: int = 4 << 20
    max_bytes: Optional[int] = None
    min_free_bytes: Optional[int] = None
    min_free_percent: Optional[float] = None
    model_id: Optional[str] = None
    stats_flush_seconds: float = 5.0
    file_mode: int = DEFAULT_FILE_MODE
    auth_key_file: Optional[str] = None
    auth_key_env: Optional[str] = None
    host_bytes: Optional[int] = None
    """Bytes of page payload the host-memory tier of each worker (``KvService``) holds in front of
    the disk (``gdskv.hosttier``); 0 turns it off. Unset: 4 GiB, or an eighth of the machine's
    memory where that is less (``gdskv.hosttier.tier_bytes``)."""
    metrics_port: Optional[int] = None
    """Prometheus metrics of each serving process on ``metrics_port + tp_rank`` (``0``: any free
    port, logged); None (default): off. See ``gdskv.metrics``."""
    metrics_host: str = "0.0.0.0"
    """The address the metrics endpoint listens on."""
    window_aware: bool = False
    """Window-aware serving for sliding-window layer groups (TensorRT-LLM connector): a sliding
    group needs only the blocks inside its window before the served length, so the served prefix
    may run past the smallest window; it also saves only those (bytes per request bounded by the
    window). False: the spec's smallest-window rule (the prefix stops at the first block any group
    misses)."""
    remote: Optional[RemoteConfig] = None
    """``[gdskv.remote]``: the shared tier on S3-compatible object storage; None: local only."""
    async_load_min_bytes: Optional[int] = DEFAULT_ASYNC_LOAD_MIN_BYTES
    """Smallest load (bytes per TP rank) a connector makes asynchronous where the engine allows it
    (TensorRT-LLM: ``is_async=True``; the request is held out of the batch until the load is
    reported finished, so it never stalls the other requests' steps). Smaller loads run inside
    the forward pass, overlapped per layer, which saves the loading request a step. 0: every
    load asynchronous; ``None`` (``false`` in TOML): none."""

    background_nice: int = 19
    """How much nicer (``nice(1)``: 0-19) than the engine's thread the transfer threads of saves
    and asynchronous loads run, so that where the engine keeps the CPUs busy those transfers take
    the time it leaves rather than stretching its steps (``gdskv.priority``; Linux). Loads a
    forward pass waits for keep the engine's priority. 0: one pool for everything."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check and normalise every setting (sizes parsed, ``false`` as None), or raise
        ``ConfigError`` naming the first bad one. Called on construction, so a config object
        that exists is a valid one."""
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"gdskv config: {key} {why}")

        if not isinstance(self.store_path, str) or not self.store_path or "\0" in self.store_path:
            raise bad("store_path", f"must be a non-empty path without NUL characters, got {self.store_path!r}")
        if self.engine not in ENGINES:
            raise bad("engine", f"must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        for key in ("io_threads", "kvikio_threads"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 256:
                raise bad(key, f"must be an integer in [1, 256], got {v!r}")
        v = self.background_nice
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 19:
            raise bad("background_nice", f"must be an integer in [0, 19] (0: transfers at the engine's priority), got {v!r}")
        if isinstance(self.o_direct, bool):
            self.o_direct = "all" if self.o_direct else "off"
        if self.o_direct not in O_DIRECT_MODES:
            raise bad("o_direct", f"must be one of {', '.join(O_DIRECT_MODES)} (or true/false), got {self.o_direct!r}")
        if not isinstance(self.fsync, bool):
            raise bad("fsync", f"must be true or false, got {self.fsync!r}")
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise bad("metrics_port", f"must be a port number in [0, 65535] (0: any free port), got {port!r}")
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise bad("metrics_host", f"must be a non-empty address, got {self.metrics_host!r}")
        if not isinstance(self.window_aware, bool):
            raise bad("window_aware", f"must be true or false, got {self.window_aware!r}")
        if self.async_load_min_bytes is False:  # TOML has no None: false turns asynchronous loads off
            self.async_load_min_bytes = None
        for key in ("kvikio_task_size", "max_bytes", "min_free_bytes", "async_load_min_bytes", "host_bytes"):
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
        f = self.stats_flush_seconds
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
            raise bad("stats_flush_seconds", f"must be a positive number of seconds, got {f!r}")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise bad("model_id", f"must be a non-empty string, got {self.model_id!r}")
        try:
            self.file_mode = parse_file_mode(self.file_mode)
        except ValueError as e:
            raise bad("file_mode", str(e)) from None
        for key in ("auth_key_file", "auth_key_env"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(key, f"must be a non-empty string, got {v!r}")
        if self.auth_key_file is not None and self.auth_key_env is not None:
            raise ConfigError("gdskv config: auth_key_file and auth_key_env are both set; set at most one")
        if self.remote is not None:
            self.remote = RemoteConfig.from_toml(self.remote)

    @property
    def dir_mode(self) -> int:
        """The mode of directories gdskv creates: ``file_mode`` plus search (x) wherever it
        grants read (0o600 → 0o700, 0o640 → 0o750)."""
        return self.file_mode | ((self.file_mode & 0o444) >> 2)

    def auth_key(self) -> Optional[bytes]:
        """The secret chunk-authentication key, or None when neither ``auth_key_file`` nor
        ``auth_key_env`` is set. Called once at bring-up; raises ``ConfigError`` naming the
        setting when the key is missing, unreadable, shorter than 16 bytes, or (a file) lies
        inside the store (the key must never be stored with the chunks it authenticates)."""
        if self.auth_key_file is not None:
            setting = "auth_key_file"
            key = self._read_key_file()
        elif self.auth_key_env is not None:
            setting = "auth_key_env"
            raw = os.environb.get(os.fsencode(self.auth_key_env))
            if not raw:
                raise ConfigError(f"gdskv config: auth_key_env: environment variable {self.auth_key_env} is not set or empty")
            key = _decode_key(raw)
        else:
            return None
        if len(key) < MIN_AUTH_KEY_BYTES:
            raise ConfigError(f"gdskv config: {setting}: the key is {len(key)} bytes; it must be at least "
                              f"{MIN_AUTH_KEY_BYTES} (e.g. 64 hex digits from `openssl rand -hex 32`)")
        return key

    def _read_key_file(self) -> bytes:
        def bad(why: str) -> ConfigError:
            return ConfigError(f"gdskv config: auth_key_file {self.auth_key_file}: {why}")

        given = Path(os.path.abspath(os.path.expanduser(self.auth_key_file)))
        store = Path(os.path.abspath(os.path.expanduser(self.store_path)))
        try:
            real = given.resolve(strict=True)
        except FileNotFoundError:
            raise bad("does not exist") from None
        except (OSError, RuntimeError) as e:
            raise bad(f"cannot be resolved ({e})") from None
        if any(_inside(p, root) for p in (given, real) for root in (store, store.resolve())):
            raise bad(f"lies inside the store ({self.store_path}); keep the key outside it")
        try:
            st = os.stat(real)
            if not stat.S_ISREG(st.st_mode):
                raise bad("is not a regular file")
            if st.st_size > MAX_KEY_FILE_BYTES:
                raise bad(f"is {st.st_size} bytes; a key file holds at most {MAX_KEY_FILE_BYTES} (e.g. 64 hex digits)")
            with open(real, "rb") as f:
                return _decode_key(f.read(MAX_KEY_FILE_BYTES))
        except OSError as e:
            raise bad(f"cannot be read ({e.strerror or e})") from None


_FIELDS = {f.name for f in dataclasses.fields(GdsKvConfig)}


def load_config(path: Optional[str] = None, /, **overrides: Any) -> GdsKvConfig:
    """Build the config (see the module docstring for precedence)."""
    values: dict[str, Any] = {}
    path = path or os.environ.get(ENV_CONFIG)
    if path:
        p = Path(path)
        try:
            st = os.stat(p)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
                why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"is {st.st_size} bytes"
                raise ConfigError(f"gdskv config: {path} (from {ENV_CONFIG}) {why}; a config is a TOML file "
                                  f"of at most {MAX_CONFIG_BYTES} bytes")
            text = p.read_bytes().decode("utf-8")
            data = tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"gdskv config: file {path} (from {ENV_CONFIG}) does not exist") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"gdskv config: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"gdskv config: {path} cannot be read ({e.strerror or e})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"gdskv config: {path} is not valid TOML: {e}") from None
        except RecursionError:  # arrays or inline tables nested past the parser
            raise ConfigError(f"gdskv config: {path} is not valid TOML: nested too deeply to parse") from None
        if "gdskv" in data:
            section = data["gdskv"]
            if not isinstance(section, dict):
                raise ConfigError(f"gdskv config: gdskv in {path} must be a table ([gdskv]), got {type(section).__name__} {section!r}")
            for key in data:
                if key != "gdskv":
                    raise ConfigError(f"gdskv config: {key!r} stands at the top level of {path}, outside the [gdskv] "
                                      f"table, and would be ignored; move it under [gdskv]")
            data = section
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
    if isinstance(values.get("store_path"), str):
        values["store_path"] = os.path.expanduser(values["store_path"])
    return GdsKvConfig(**values)
