"""What our daemon's /metrics says about a run of bench/http_serve.py: its step counters as differences of two
scrapes, its latest steps' times, and the run's time to first token (and the steps it took) from the difference
of two scrapes of the daemon's histograms, where percentiles over the latest prompts would mix in a warm-up's."""
from __future__ import annotations

import httpx

DAEMON_FIGURES = ("kestrel_steps_total", "kestrel_decode_steps_total", "kestrel_decode_step_seconds_total",
                  "kestrel_prompt_tokens_total", "kestrel_decode_tokens_total")
# the daemon's figures over its latest steps (read after the run, not as differences)
LATEST_FIGURES = ("kestrel_step_p50_seconds", "kestrel_step_p99_seconds")
# histograms of every prompt since the start: the run's prompts are the difference of two scrapes (the latest
# prompts' percentiles would mix in the warm-up's)
HISTOGRAMS = ("kestrel_ttft_seconds", "kestrel_ttft_steps")


def daemon_figures(base_url: str, headers: dict) -> dict:
    """Our daemon's step counters from its /metrics (the daemon's own figures, read at each scrape); a histogram
    as {name: {upper bound: cumulative count}}."""
    text = httpx.get(base_url.rsplit("/v1", 1)[0] + "/metrics", headers=headers, timeout=30).text
    figures = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in DAEMON_FIGURES or name in LATEST_FIGURES:
            figures[name] = float(value)
        elif name.endswith('"}') and name.split("_bucket{le=")[0] in HISTOGRAMS:
            family, _, bound = name[:-2].partition('_bucket{le="')
            figures.setdefault(family, {})[float(bound)] = float(value)
    return figures


def histogram_percentile(before: dict, after: dict, fraction: float, whole: bool = False) -> float | None:
    """The `fraction` percentile of what a histogram counted between two scrapes ({upper bound: cumulative
    count}), interpolated within its bucket as Prometheus' histogram_quantile does (whole: counts of whole
    numbers, each bound one of them: the bucket's bound); None if nothing was counted."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = fraction * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower                     # above the last finite bound: that bound, as Prometheus says
            if whole:
                return bound
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


def run_percentiles(before: dict, after: dict, family: str) -> dict:
    """p50 and p99 of a histogram family over the run (None where the daemon has no such histogram)."""
    if family not in after:
        return {"p50": None, "p99": None}
    return {key: histogram_percentile(before.get(family, {}), after[family], fraction, family.endswith("_steps"))
            for key, fraction in (("p50", 0.5), ("p99", 0.99))}


def step_columns(before: dict, after: dict) -> dict:
    """What the daemon's steps did over a run: steps, the mean decode step's time and tokens a step, and the
    daemon's own time to first token (from a prompt's arrival at the daemon: the HTTP layer's share is the
    row's TTFT less it)."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in DAEMON_FIGURES}
    steps, decode_steps = delta["kestrel_steps_total"], delta["kestrel_decode_steps_total"]
    tokens = delta["kestrel_prompt_tokens_total"] + delta["kestrel_decode_tokens_total"]
    return {"steps": int(steps),
            "mean_step_ms": round(1e3 * delta["kestrel_decode_step_seconds_total"] / decode_steps, 2)
            if decode_steps else None,
            "tokens_per_step": round(tokens / steps, 1) if steps else None,
            "daemon_prompts": (int(after["kestrel_ttft_seconds"][float("inf")]
                                   - before.get("kestrel_ttft_seconds", {}).get(float("inf"), 0.0))
                               if "kestrel_ttft_seconds" in after else None),
            **{f"daemon_ttft_{key}_ms": round(1e3 * value, 1) if value is not None else None
               for key, value in run_percentiles(before, after, "kestrel_ttft_seconds").items()},
            **{f"daemon_ttft_steps_{key}": round(value, 1) if value is not None else None
               for key, value in run_percentiles(before, after, "kestrel_ttft_steps").items()},
            "step_p50_ms": round(1e3 * after["kestrel_step_p50_seconds"], 2) if "kestrel_step_p50_seconds" in after
            else None,
            "step_p99_ms": round(1e3 * after["kestrel_step_p99_seconds"], 2) if "kestrel_step_p99_seconds" in after
            else None}
