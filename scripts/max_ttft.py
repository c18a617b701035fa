"""``scripts/bench_ttft.py``'s MAX section: time to first token on Modular MAX (``max serve`` on
CPU) with the prompt's prefix served from gdskv's store, page cache dropped, against MAX
computing it.

MAX runs from its own virtualenv, the one ``tests/test_max_integration.py`` makes
(``~/.cache/gdskv-test/venv-max``, or ``--max-python``); this bench never installs it and skips the
section with the reason when it is not usable. The model is a random fp32 Llama built offline by
``scripts/make_tiny_llama.py`` with the reference section's geometry (8 layers, hidden 1024, ...),
so prefill costs real time on a CPU. Per prompt length, with a prompt of its own:

1. ``computed``: plain ``max serve`` (no connector), one streamed greedy completion;
2. ``computed+saving``: ``max serve`` through gdskv's launcher on an empty store: computes the
   prompt and offloads its full blocks;
3. ``served cold``: a new ``max serve`` with gdskv after every chunk file's page cache was
   dropped: the prefix is loaded from the store.

TTFT is measured at the client: from sending the request to the first streamed token. Each
server runs every length, in order, on one process (MAX's compile cache makes later starts take
seconds). The served run must give the computed run's text (greedy), else the bench fails.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from gdskv.peers import venv_root

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 900.0
REQUEST_TIMEOUT = 1800.0
PROBE = "import max.pipelines, gdskv.connectors.max"
WORDS = " ".join(["the quick brown fox jumps over the lazy dog",
                  "a persistent key value cache keeps attention pages on fast storage",
                  "large language models reuse the prefix of a long prompt"]).split()


class MaxUnavailable(RuntimeError):
    """The MAX section cannot run here; the message says why (the report prints it)."""


def max_python(given: Optional[str]) -> Path:
    """The interpreter of a virtualenv with MAX and this checkout of gdskv; else ``MaxUnavailable``."""
    py = Path(given) if given else venv_root() / "venv-max" / "bin" / "python"
    if not py.exists():
        raise MaxUnavailable(f"no MAX virtualenv at {py.parent.parent} ({py} does not exist; made by "
                             "tests/test_max_integration.py; this bench does not install MAX)")
    probe = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, env=max_env(py, {}), cwd=REPO)
    if probe.returncode != 0:
        raise MaxUnavailable(f"{py} cannot import MAX and gdskv: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    return py


def max_env(python: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a process of MAX's virtualenv (``python`` is its interpreter): none
    of this process's gdskv settings, no virtualenv on ``PATH`` (as a user runs the
    virtualenv's interpreter without activating it), offline, no telemetry, the compile cache
    inside that virtualenv (unless ``MODULAR_CACHE_DIR`` names one), then ``extra``. Also used
    by ``tests/test_max_integration.py``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKV_") and k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(d).parent / "pyvenv.cfg").exists())
    env.update(HF_HUB_OFFLINE="1", MAX_SERVE_DISABLE_TELEMETRY="1")
    env.setdefault("MODULAR_CACHE_DIR", str(python.parent.parent / "modular-cache"))
    env.update(extra)
    return env


def build_model(python: Path, out: Path, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                max_positions: int) -> Path:
    subprocess.run([str(python), str(REPO / "scripts" / "make_tiny_llama.py"), str(out), "--layers", str(layers),
                    "--heads", str(heads), "--kv-heads", str(kv_heads), "--head-dim", str(head_dim),
                    "--intermediate", str(intermediate), "--max-positions", str(max_positions)],
                   check=True, capture_output=True, env=max_env(python, {}), cwd=REPO)
    return out


_PROMPTS = """
import json, random, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
words, out = sys.argv[2].split(), {}
for n in json.loads(sys.argv[3]):
    rng = random.Random(31000 + n)
    text = []
    while len(tok(" ".join(text))["input_ids"]) < n:
        text += [rng.choice(words) for _ in range(max(1, (n - len(tok(" ".join(text))["input_ids"])) // 3))]
    out[n] = " ".join(text)
print(json.dumps(out))
"""


def prompts_of(python: Path, model: Path, lengths: tuple[int, ...]) -> dict[int, str]:
    """A prompt of at least n tokens of the model's tokenizer per length n, each its own (seeded
    by n: no shared prefix), made by MAX's python (the tokenizer lives there)."""
    out = subprocess.run([str(python), "-c", _PROMPTS, str(model), " ".join(WORDS), json.dumps(list(lengths))],
                         check=True, capture_output=True, text=True, env=max_env(python, {}), cwd=REPO)
    return {int(k): v for k, v in json.loads(out.stdout).items()}


@dataclass
class Server:
    """One ``max serve`` process on a free local port: plain, or through gdskv's launcher on
    ``store`` (counters to ``stats``). Stopped with SIGINT, as an operator would."""

    python: Path
    model: Path
    max_length: int
    store: Optional[Path] = None
    stats: Optional[Path] = None
    log: Optional[Path] = None

    def __enter__(self) -> "Server":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = ["serve", "--model-path", str(self.model), "--devices", "cpu", "--max-length", str(self.max_length),
                "--max-batch-size", "1", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.store is None:
            cmd = [str(self.python), "-c", "import sys; from max._entrypoints.pipelines import main; "
                   "sys.argv[0] = 'max'; sys.exit(main())", *args]
            extra: dict[str, str] = {}
        else:
            cmd = [str(self.python), "-m", "gdskv.connectors.max_launch", *args,
                   "--kv-connector-config", '{"type":"rust_tiered"}']
            extra = {"GDSKV_STORE": str(self.store), "GDSKV_MAX_METRICS": str(self.stats)}
        self._out = open(self.log, "w") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=max_env(self.python, extra), cwd=REPO)
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self._stop()
                raise RuntimeError(f"max serve exited early ({self.proc.returncode}); see {self.log}")
            if time.monotonic() - start > START_TIMEOUT:
                self._stop()
                raise RuntimeError(f"max serve did not come up in {START_TIMEOUT:.0f} s; see {self.log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/v1/models")
                conn.getresponse().read()
                self.startup_s = time.monotonic() - start
                return self
            except OSError:
                time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._out is not subprocess.DEVNULL:
            self._out.close()

    def complete(self, prompt: str, max_tokens: int) -> tuple[float, str, int]:
        """One streamed greedy completion: (seconds to the first token, text, prompt tokens)."""
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "top_k": 1,
                "seed": 0, "stream": True, "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT)
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"max serve answered {reply.status}: {reply.read()[:500]!r}")
        first, text, tokens = None, [], 0
        for event in _events(reply):
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter() - sent
                    text.append(choice["text"])
            tokens = (event.get("usage") or {}).get("prompt_tokens", tokens)
        if first is None:
            raise RuntimeError("max serve streamed no token")
        return first, "".join(text), tokens


def _events(reply: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON events of a server-sent event stream, up to ``[DONE]``."""
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def max_section(python: Path, workdir: Path, lengths: tuple[int, ...], layers: int, heads: int, kv_heads: int,
                head_dim: int, intermediate: int, drop_cache: Callable[[str], None], log=print) -> list[dict]:
    """The rows of the MAX table, one per prompt length (with the prompt tokens MAX counted);
    raises when a served run's text differs from the computed one or nothing was served.
    ``drop_cache(store_path)`` drops the page cache of the store's chunk files."""
    max_length = max(lengths) + 256
    model = build_model(python, workdir / "max-model", layers, heads, kv_heads, head_dim, intermediate, max_length + 64)
    prompts = prompts_of(python, model, lengths)
    store = workdir / "max-store"
    runs: dict[str, dict[int, tuple[float, str, int]]] = {}
    served_stats: dict = {}
    for label, with_store in [("computed", False), ("computed+saving", True), ("served cold", True)]:
        if label == "served cold":
            drop_cache(str(store))
        log(f"max: {label} ...")
        stats = workdir / f"max-{label.replace(' ', '-').replace('+', '-')}.json"
        with Server(python, model, max_length, store if with_store else None, stats if with_store else None,
                    log=stats.with_suffix(".log")) as server:
            log(f"max: {label}: server up in {server.startup_s:.0f} s")
            runs[label] = {n: server.complete(prompts[n], 4) for n in lengths}
        if label == "served cold":
            served_stats = json.loads(stats.read_text())
    if not served_stats.get("blocks_read"):
        raise RuntimeError(f"max: the served runs read no block from the store (connector counters {served_stats})")
    rows = []
    for n in lengths:
        computed, served = runs["computed"][n], runs["served cold"][n]
        if served[1] != computed[1]:
            raise RuntimeError(f"max: the served run of {n} tokens generated {served[1]!r}, computed {computed[1]!r}")
        rows.append({"prompt_tokens": computed[2], "computed_s": computed[0], "computed+saving_s": runs["computed+saving"][n][0],
                     "served_cold_s": served[0], "served_over_computed": served[0] / computed[0]})
    return rows
