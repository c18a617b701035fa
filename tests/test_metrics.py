"""Prometheus metrics: a real reference-engine process with metrics on, scraped over HTTP and
parsed by prometheus_client's parser; ``gdskv stats --prometheus`` parsed the same way; the
mapping of counters to families; the setting's checks; a taken port never stops serving."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from gdskv.cli.main import main
from gdskv.config import ConfigError, GdsKvConfig
from gdskv.metrics import Labels, counter_families

REPO = Path(__file__).resolve().parents[1]

# The reference engine with the TensorRT-LLM connector (prewarm's stack), metrics on an ephemeral
# port: run 1 computes and saves a prompt; run 2, a fresh engine in the same process, is served
# from the store. Then it prints its port and waits for stdin to close.
ENGINE = textwrap.dedent("""
    import json, sys
    from gdskv.config import GdsKvConfig
    from gdskv.cli.prewarm import reference_stack
    from gdskv.metrics import serving_port

    cfg = GdsKvConfig(store_path=sys.argv[1], metrics_port=int(sys.argv[2]), metrics_host="127.0.0.1")
    prompt = list(b"The store keeps every block it has seen, so a second server starts warm. " * 2)
    served = []
    for run in range(2):
        stack = reference_stack(cfg, 256, 256)
        [res] = stack.engine.generate([prompt], max_new_tokens=1)
        served.append(res.prefill_tokens_loaded)
        stack.close()
    print(json.dumps({"port": serving_port(), "served": served}), flush=True)
    sys.stdin.read()
""")


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in found.get(name, []) if all(lab.get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[int]]:
    store = tmp_path_factory.mktemp("metrics") / "store"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GDSKV_CONFIG", None)
    env.pop("GDSKV_STORE", None)
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(store), "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        ready = json.loads(line)
        with urllib.request.urlopen(f"http://127.0.0.1:{ready['port']}/metrics", timeout=10) as r:
            assert r.status == 200
            body = r.read().decode()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read()
    return body, store, ready["served"]


def test_a_running_engine_serves_hit_byte_and_latency_series(scraped: tuple[str, Path, list[int]]) -> None:
    body, _, served = scraped
    assert served[0] == 0 and served[1] > 0
    found = samples(body)
    mine = {"engine": "trtllm", "tp_rank": "0"}
    assert total(found, "gdskv_lookups_total", **mine) == 2
    assert total(found, "gdskv_served_tokens_total", **mine) == served[1]
    assert total(found, "gdskv_requested_tokens_total", **mine) >= 2 * served[1]
    assert total(found, "gdskv_loads_total", result="hit", **mine) > 0
    assert total(found, "gdskv_saves_total", result="published", **mine) > 0
    assert total(found, "gdskv_read_bytes_total", **mine) > 0 and total(found, "gdskv_written_bytes_total", **mine) > 0
    for op in ("lookup", "load", "save"):
        assert total(found, "gdskv_operation_seconds_count", op=op, **mine) > 0, op
        assert total(found, "gdskv_operation_seconds_sum", op=op, **mine) > 0, op
    assert total(found, "gdskv_filesystem_free_bytes") > 0
    assert total(found, "gdskv_store_bytes") > 0
    assert "gdskv_host_tier_hits_total" in found
    [ns] = {lab["namespace"] for lab, _ in found["gdskv_lookups_total"]}
    assert len(ns) == 16 and all(lab["model"] for lab, _ in found["gdskv_loads_total"])


def test_stats_prometheus_is_parsed_by_the_client_library(scraped: tuple[str, Path, list[int]]) -> None:
    _, store, served = scraped
    res = CliRunner().invoke(main, ["--store", str(store), "stats", "--prometheus"])
    assert res.exit_code == 0, res.output
    found = samples(res.stdout)
    assert total(found, "gdskv_lookups_total") == 2
    assert total(found, "gdskv_served_tokens_total") == served[1]
    assert total(found, "gdskv_loads_total", result="hit") > 0 and total(found, "gdskv_read_bytes_total") > 0
    assert total(found, "gdskv_store_bytes") > 0 and total(found, "gdskv_store_chunks") > 0
    assert all("engine" not in lab and lab["tp_rank"] == "0" for lab, _ in found["gdskv_lookups_total"])
    both = CliRunner().invoke(main, ["--store", str(store), "stats", "--prometheus", "--json"])
    assert both.exit_code == 2 and "give one" in both.output


def test_counters_map_to_families_with_reasons_and_other_counters_are_kept() -> None:
    lab = Labels("ns1", "m", 1, "vllm")
    fams = {f.name: f for f in counter_families([
        (lab, {"saves_dropped": 5, "saves_dropped_budget": 2, "saves_error": 1, "quarantined": 3,
               "quarantined_bad-checksum": 2, "quarantined_truncated": 1, "remote_hits": 7}),
        (lab, {"lookups": 4}),  # a second service of the same process: summed
    ])}
    dropped = {s.labels["reason"]: s.value for s in fams["gdskv_saves_dropped"].samples}
    assert dropped == {"budget": 2, "error": 1, "other": 2}
    assert {s.labels["reason"]: s.value for s in fams["gdskv_corrupt_chunks"].samples} == {"bad-checksum": 2, "truncated": 1}
    assert [(s.labels["event"], s.value) for s in fams["gdskv_events"].samples] == [("remote_hits", 7)]
    assert [s.value for s in fams["gdskv_lookups"].samples] == [4]
    assert fams["gdskv_lookups"].samples[0].labels == {"engine": "vllm", "namespace": "ns1", "model": "m", "tp_rank": "1"}
    assert [s.value for s in fams["gdskv_host_tier_hits"].samples] == [0]


@pytest.mark.parametrize("port", [-1, 65536, True, "9400", 1.5])
def test_metrics_port_must_be_a_port_number(tmp_path: Path, port: object) -> None:
    with pytest.raises(ConfigError, match="metrics_port"):
        GdsKvConfig(store_path=str(tmp_path), metrics_port=port)  # type: ignore[arg-type]


def test_a_taken_metrics_port_is_logged_and_the_engine_still_serves(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = ENGINE.replace('print(json.dumps({"port": serving_port(), "served": served}), flush=True)\nsys.stdin.read()',
                                'print(json.dumps({"port": serving_port(), "served": served}), flush=True)')
        env = dict(os.environ, OMP_NUM_THREADS="1")
        res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store"), str(port)], capture_output=True, text=True,
                             env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["port"] is None and out["served"][1] > 0
    assert "metrics_port" in res.stderr and f":{port}" in res.stderr


def test_the_grafana_dashboard_charts_only_metrics_gdskv_exports(scraped: tuple[str, Path, list[int]]) -> None:
    """Every series the dashboard queries is in a real scrape (or is a family gdskv makes)."""
    import re

    body, _, _ = scraped
    exported = set(samples(body)) | {f"{f.name}_total" for f in counter_families([(Labels("n", "m", 0), {
        "evicted": 1, "evicted_bytes": 1, "saves_dropped": 1, "quarantined_bad-checksum": 1})])}
    dash = json.loads((REPO / "config" / "grafana-dashboard.json").read_text())
    queried = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"gdskv_\w+", t["expr"])}
    assert queried and queried <= exported, queried - exported
