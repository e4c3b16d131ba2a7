"""The daemon's ``stats``: each replica's figures under ``replicas``, and their totals in the shape one engine's had.

A total is the sum of the replicas' figures, except for figures that are
maxima (the most tokens in one step), settings every replica shares (the
step's budget, the KV block's size) and ratios, which are computed again from
the summed parts (the mean batch from requests and batches, the time to first
token's percentiles from every replica's samples, speculation's acceptance
from the drafted and accepted tokens).  With one replica the totals are its
figures.  Read from any thread: every collection is copied in one step.
"""
from __future__ import annotations

from scheduler.step_log import step_figures, ttft_figures

from kestrel_stream.spec.decoder import SpecStats

MAXIMA = frozenset({"max_tokens_in_step", "max_decode_wait_steps"})
SHARED = frozenset({"max_batch", "window_ms", "step_tokens", "prompt_order", "kv_block_size", "kv_block_bytes", "kv_dtype",
                    "kind", "policy", "draft_max", "pass_curve"})
OWN = ("replica", "device", "mode", "plan", "residency", "held_sessions", "load", "placed", "placed_by_prefix")


def replica_stats(replica) -> dict:
    engine, executor = replica.engine, replica.engine.executor
    sessions = list(engine.sessions.values())
    return {"replica": replica.index, "device": replica.device, "mode": engine.mode, "plan": replica.plan,
            "residency": replica.residency, "counters": executor.counters.as_dict(), "kv": executor.kv_stats(),
            "prefix_cache": replica.prefix_scopes.stats(), "sessions": len(sessions),
            "held_sessions": replica.held, "load": replica.load, "placed": replica.placed,
            "placed_by_prefix": replica.placed_by_prefix,
            "kv_positions_used": sum(s.position for s in sessions),
            "kv_positions_allocated": sum(s.max_seq_len for s in sessions),
            **replica.batcher.stats(), **replica.counters, "errors": replica.decode_steps.errors,
            "step_errors": replica.decode_steps.failed,
            "inline_steps": replica.steps.inline_steps, "speculation": replica.spec_totals.as_dict()}


def add_up(figures: list[dict]) -> dict:
    """The replicas' figures (dicts of the same keys) as one: sums, maxima, shared settings (see above)."""
    total = {}
    for key, first in figures[0].items():
        values = [f.get(key) for f in figures]
        if isinstance(first, dict):
            total[key] = add_up([v or {} for v in values])
        elif key in MAXIMA:
            total[key] = max(values)
        elif key in SHARED or not all(type(v) in (int, float) for v in values):
            total[key] = first
        else:
            total[key] = sum(values)
    return total


def totals(replicas, figures: list[dict]) -> dict:
    """The replicas' figures added up, their ratios computed again."""
    if len(figures) == 1:
        return {k: v for k, v in figures[0].items() if k not in OWN}
    total = {k: v for k, v in add_up(figures).items() if k not in OWN}
    total["mean_batch"] = round(total["batched_requests"] / total["batches"], 3) if total["batches"] else 0.0
    step_tokens = sum(f["tokens_per_step"] * f["steps"] for f in figures)
    total["tokens_per_step"] = round(step_tokens / total["steps"], 3) if total["steps"] else 0.0
    logs = [replica.batcher.log for replica in replicas]
    ttft = [t for log in logs for t in list(log.ttft_s)]
    total["ttft_ms"] = (ttft_figures(ttft, [n for log in logs for n in list(log.ttft_steps)]) if ttft
                        else figures[0]["ttft_ms"])
    total["step_ms"] = step_figures([t for log in logs for t in list(log.step_s)])
    if total.get("speculation") is not None:
        merged = SpecStats()
        for replica in replicas:
            for name, value in vars(replica.spec_totals.stats).items():
                setattr(merged, name, getattr(merged, name) + value)
        total["speculation"].update(merged.as_dict())
    return total


def daemon_stats(service) -> dict:
    """What the ``stats`` op answers (and /metrics reads)."""
    replicas = service.replicas
    figures = [replica_stats(replica) for replica in replicas]
    total = totals(replicas, figures)
    engine = service.engine
    return {
        "model": str(getattr(engine.weights, "source", "")) or None,
        "device": engine.device, "mode": engine.mode,
        "plan": replicas[0].plan,
        "residency": replicas[0].residency,
        **total,
        "max_sessions": service.max_sessions,
        "connections": len(service.connections), "inflight": service.inflight,
        **service.admission.stats(), **service.counters,
        **{key: total[key] for key in ("decode_steps", "generated_tokens", "decode_step_s")},
        "errors": service.counters["errors"] + total["errors"],
        "requests": service.counters["requests"] + service.queued_at_once + service.stats_at_once_count,
        "inline_steps": total["inline_steps"],
        "replicas": figures,
    }
