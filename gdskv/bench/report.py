"""The bench's report: each row's ratios against the baselines and peers of the same run, the
targets of issue 13, and the table ``gdskv bench`` prints.
"""
from __future__ import annotations

from typing import Any

from gdskv.io import batch as batchio


KINDS = ("save", "load_cold", "load_warm")


SAVE_TARGET = 0.85  # store save >= 0.85 x the best raw durable write (issue 13)


LOAD_TARGET = 0.9  # store cold load >= 0.9 x the disk's ceiling


PEER_TARGET = 1.1  # store cold load >= 1.1 x vLLM's file-system tier


WARM_TARGET = 1.0  # store warm load >= plain buffered reads of the same files


HOT_TARGET = 5.0  # a host-tier hit >= 5 x a cold load (subjects with a tier)


def add_ratios(report: dict[str, Any], page_bytes: int) -> None:
    """Store rows get ``vs_ceiling`` (cold load), ``vs_vllm`` (cold load, where the vLLM tier
    ran), ``vs_raw`` (per kind, against the better of ``raw`` and ``raw+o_direct``: for saves,
    the raw durable write) and ``meets_target`` (save >= SAVE_TARGET x raw, cold >= LOAD_TARGET x
    ceiling, and >= PEER_TARGET x vLLM where it ran, warm >= WARM_TARGET x ``files``, hot >=
    HOT_TARGET x cold where the subject has a host tier)."""
    rows = {r["subject"]: r for r in report["results"] if r["page_bytes"] == page_bytes}
    raws = [row for name, row in rows.items() if name.startswith("raw")]
    ceiling, vllm, files = rows.get("ceiling"), rows.get("peer:vllm-fs-tier"), rows.get("files")
    for name, row in rows.items():
        if not name.startswith(("store:", "service:")):
            continue
        if row.get("load_hot_gbps"):
            row["hot_vs_cold"] = row["load_hot_gbps"] / row["load_cold_gbps"]
        met = [row["hot_vs_cold"] >= HOT_TARGET] if "hot_vs_cold" in row else []
        if raws:
            row["vs_raw"] = {k: row[f"{k}_gbps"] / max(r[f"{k}_gbps"] for r in raws) for k in KINDS}
            met.append(row["vs_raw"]["save"] >= SAVE_TARGET)
        if files:
            row["warm_vs_files"] = row["load_warm_gbps"] / files["load_warm_gbps"]
            met.append(row["warm_vs_files"] >= WARM_TARGET)
        if ceiling:
            row["vs_ceiling"] = row["load_cold_gbps"] / ceiling["load_cold_gbps"]
            met.append(row["vs_ceiling"] >= LOAD_TARGET)
        if vllm:
            row["vs_vllm"] = row["load_cold_gbps"] / vllm["load_cold_gbps"]
            met.append(row["vs_vllm"] >= PEER_TARGET)
        if met:
            row["meets_target"] = all(met)


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: GB/s per subject and page size, then the store's ratios."""
    lines = [f"{'page':>5} {'subject':<30} {'save':>6} {'cold':>6} {'warm':>6} {'hot':>6}   "
             f"{'cold/ceil':>9} {'cold/vllm':>9} {'save/raw':>8} {'warm/raw':>8} {'warm/files':>10} {'hot/cold':>8}  target"]

    def fmt(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    for row in report["results"]:
        raw = row.get("vs_raw") or {}
        met = row.get("meets_target")
        lines.append(
            f"{size_label(row['page_bytes']):>5} {row['subject']:<30} {row['save_gbps']:>6.2f} {row['load_cold_gbps']:>6.2f} "
            f"{row['load_warm_gbps']:>6.2f} {fmt(row.get('load_hot_gbps')):>6}   {fmt(row.get('vs_ceiling')):>9} "
            f"{fmt(row.get('vs_vllm')):>9} {fmt(raw.get('save')):>8} {fmt(raw.get('load_warm')):>8} "
            f"{fmt(row.get('warm_vs_files')):>10} {fmt(row.get('hot_vs_cold')):>8}  "
            f"{'' if met is None else ('met' if met else 'MISSED')}")
    for what, why in report["skipped"].items():
        lines.append(f"{what} left out: {why}")
    opts = report["options"]
    dio = report.get("direct_io")
    if dio:
        align, offsets = dio["memory_align"], dio["torch_pool_offsets"]
        if align == 0:
            lines.append("direct I/O: none on this file system (chunks go through the page cache)")
        else:
            rule = align or batchio.ALIGN  # what the native path assumes where the kernel does not say
            said = f"{align}-byte-aligned memory moves in place" if align else "alignment not reported (4 KiB assumed)"
            pools = ", ".join(f"{size_label(int(page))} pages +{off} B ({'in place' if off % rule == 0 else 'staged'})"
                              for page, off in offsets.items())
            lines.append(f"direct I/O: {said}" + (f"; the torch pools started past a page boundary by: {pools}" if pools else ""))
    if report.get("spread_directories") is False:
        lines.append("round directories: not spread over the disk (no chattr +T here): on ext4 without a journal, a "
                     "one-file-per-page save can pay for the files the round before it removed")
    lines.append(f"GB/s = 1e9 bytes/s; medians of {opts['rounds']} rounds of {opts['total_bytes'] >> 20} MiB; save "
                 f"includes syncfs; cold = page cache dropped; warm = files in the page cache; targets: cold >= "
                 f"{LOAD_TARGET} x ceiling and >= {PEER_TARGET} x vLLM's tier, save >= {SAVE_TARGET} x the best raw "
                 f"durable write, warm >= {WARM_TARGET} x files, hot >= {HOT_TARGET} x cold; warm/raw compares with "
                 f"the better raw warm read (a page-cache copy), warm/files with plain buffered reads of one file per "
                 f"page (the same count and sizes) at the store's depth")
    return "\n".join(lines)

def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"
