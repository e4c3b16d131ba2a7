"""Reading a trace back: step selection, rows per stream, and the numbers the timeline prints.

Works on any Chrome Trace Event file shaped like ``trace.py`` writes it: busy
time is the union of a row's slices (nested host spans count once), overlap is
the time a device had a copy and a kernel running at once.
"""
from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kestrel_stream.obs.trace import HOST_PID


def load(path: str | Path) -> list[dict]:
    """The events of a ``.json`` or ``.json.gz`` trace (object or bare-array form)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, EOFError) as e:
        raise ValueError(f"{path}: not a readable trace ({e})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list")
    return events


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """``a:b`` (b exclusive, either side optional) or a single step ``a``."""
    if not text:
        return None, None
    try:
        if ":" not in text:
            return int(text), int(text) + 1
        lo, hi = text.split(":", 1)
        return (int(lo) if lo.strip() else None), (int(hi) if hi.strip() else None)
    except ValueError:
        raise ValueError(f"--steps: expected a:b with integers, got {text!r}") from None


def select_steps(events: list[dict], first: int | None, stop: int | None) -> list[dict]:
    """Events of steps first..stop-1; metadata always, counters inside the kept time span."""
    if first is None and stop is None:
        return events

    def inside(event) -> bool:
        step = event.get("args", {}).get("step")
        return step is not None and (first is None or step >= first) and (stop is None or step < stop)

    kept = [e for e in events if e.get("ph") in ("X", "i") and inside(e)]
    if not kept:
        raise ValueError(f"--steps {first}:{stop}: no events in those steps")
    begin = min(e["ts"] for e in kept)
    end = max(e["ts"] + e.get("dur", 0) for e in kept)
    slices = {(e["pid"], e["tid"]): [] for e in kept if e["ph"] == "X"}
    for e in kept:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))

    def flow_end_kept(e) -> bool:
        return any(lo <= e["ts"] <= hi for lo, hi in slices.get((e["pid"], e["tid"]), ()))

    flows = defaultdict(list)
    for e in events:
        if e.get("ph") in ("s", "f"):
            flows[e["id"]].append(e)
    kept_flows = [e for pair in flows.values() if all(flow_end_kept(e) for e in pair) for e in pair]
    counters = [e for e in events if e.get("ph") == "C" and begin <= e["ts"] <= end]
    return [e for e in events if e.get("ph") == "M"] + kept + kept_flows + counters


@dataclass
class Row:
    pid: int
    tid: int
    process: str
    thread: str
    slices: list[dict] = field(default_factory=list)
    instants: list[dict] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.process} / {self.thread}"


def rows(events: list[dict]) -> list[Row]:
    """One row per (pid, tid) that has slices or instants, host first, then devices, in tid order."""
    process_names, thread_names = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process_names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
    by_key: dict[tuple[int, int], Row] = {}
    for e in events:
        if e.get("ph") not in ("X", "i"):
            continue
        key = (e["pid"], e["tid"])
        row = by_key.get(key)
        if row is None:
            row = by_key[key] = Row(*key, process_names.get(key[0], f"pid {key[0]}"),
                                    thread_names.get(key, f"tid {key[1]}"))
        (row.slices if e["ph"] == "X" else row.instants).append(e)
    return [by_key[k] for k in sorted(by_key)]


def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def total(intervals) -> float:
    return sum(hi - lo for lo, hi in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlap of two merged, sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def top_by_name(slices: list[dict], top: int) -> list[dict]:
    """Total time per slice name, largest first, with each name's share of the group's total."""
    ops = defaultdict(lambda: [0.0, 0])
    for e in slices:
        ops[e["name"]][0] += e["dur"]
        ops[e["name"]][1] += 1
    group_us = sum(us for us, _ in ops.values())
    return [{"name": name, "total_us": us, "calls": calls, "share_pct": 100.0 * us / group_us if group_us else 0.0}
            for name, (us, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]]


def summarize(events: list[dict], top: int = 10) -> dict:
    slices = [e for e in events if e.get("ph") == "X"]
    if not slices:
        raise ValueError("the trace has no slices (ph X events)")
    begin = min(e["ts"] for e in slices)
    window_us = max(e["ts"] + e["dur"] for e in slices) - begin
    streams = {}
    for row in rows(events):
        busy_us = total(union((e["ts"], e["ts"] + e["dur"]) for e in row.slices))
        streams[row.label] = {"busy_us": busy_us, "busy_pct": 100.0 * busy_us / window_us if window_us else 0.0}
    devices = {}
    process_names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    for pid in sorted({e["pid"] for e in slices if e["pid"] != HOST_PID}):
        copy = union((e["ts"], e["ts"] + e["dur"]) for e in slices if e["pid"] == pid and e.get("cat") == "memcpy")
        compute = union((e["ts"], e["ts"] + e["dur"]) for e in slices if e["pid"] == pid and e.get("cat") == "kernel")
        overlap_us = total(intersect(copy, compute))
        devices[process_names.get(pid, f"pid {pid}")] = {
            "copy_us": total(copy), "compute_us": total(compute), "overlap_us": overlap_us,
            "overlap_pct_of_copy": 100.0 * overlap_us / total(copy) if copy else 0.0}
    steps = [e for e in slices if e.get("name") == "step" and e.get("cat") == "host"]
    tokens = sum(int(e["args"].get("tokens", 0)) for e in steps)
    counts = {
        "host_syncs": sum(1 for e in slices if e.get("cat") == "sync"),
        "launches": sum(1 for e in slices if e.get("args", {}).get("kind") == "launch"),
        "copies": sum(1 for e in slices if e.get("args", {}).get("kind") == "copy"),
        "event_records": sum(1 for e in events if e.get("ph") == "i" and e["name"].startswith("record ")),
        "stream_waits": sum(1 for e in events if e.get("ph") == "i" and e["name"].startswith("wait ")),
    }
    per_token = {f"{k}_per_token": (v / tokens if tokens else 0.0) for k, v in counts.items()}
    device_ops = top_by_name([e for e in slices if e["pid"] != HOST_PID], top)
    host_ops = top_by_name([e for e in slices if e["pid"] == HOST_PID and "op" in e.get("args", {})], top)
    return {"window_us": window_us, "steps": len(steps), "tokens": tokens, "streams": streams,
            "devices": devices, **counts, **per_token, "top_device_ops": device_ops, "top_host_ops": host_ops}


def format_summary(summary: dict) -> str:
    lines = [f"{summary['steps']} steps, {summary['tokens']} tokens, {summary['window_us'] / 1000:.3f} ms traced"]
    lines.append("busy per stream:")
    for label, s in summary["streams"].items():
        lines.append(f"  {label:<32} {s['busy_pct']:6.1f} %  ({s['busy_us'] / 1000:.3f} ms)")
    for device, d in summary["devices"].items():
        lines.append(f"{device}: copy {d['copy_us'] / 1000:.3f} ms, compute {d['compute_us'] / 1000:.3f} ms, "
                     f"overlap {d['overlap_us'] / 1000:.3f} ms ({d['overlap_pct_of_copy']:.1f} % of copy time)")
    lines.append(f"per token: {summary['host_syncs_per_token']:.2f} host syncs, "
                 f"{summary['launches_per_token']:.2f} launches, {summary['copies_per_token']:.2f} copies, "
                 f"{summary['event_records_per_token']:.2f} event records, "
                 f"{summary['stream_waits_per_token']:.2f} stream waits")
    for key, title in (("top_device_ops", "top device ops (kernels, copies) by time:"),
                       ("top_host_ops", "top host ops by time:")):
        if summary[key]:
            lines.append(title)
        for op in summary[key]:
            lines.append(f"  {op['name']:<24} {op['total_us'] / 1000:9.3f} ms  {op['share_pct']:5.1f} %  "
                         f"{op['calls']} calls")
    return "\n".join(lines)
