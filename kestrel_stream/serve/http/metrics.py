"""/metrics: Prometheus text from prometheus-client, in a registry of the app's own.

HTTP counts (requests by path and status, prompt and completion tokens, time
to first token) are recorded as requests pass; the daemon's own figures
(steps, step time, batch size, queue depth, admission queue depth and wait, sessions, KV positions and pool
blocks, window hits and misses, prefix cache hits, time to first token and its steps as histograms of every
prompt, in the same buckets as the HTTP one) are read from
Service.stats() at each scrape, so socket and HTTP clients are counted alike
and nothing is added to the step thread's work.

With several replicas (serve --devices) each family of the daemon's figures
keeps its name for the totals, and ``kestrel_replica_*`` families carry
each replica's figures under a ``replica`` label (its index) and a ``device``
label: summed over ``replica``, a counter or gauge of those is the total of
the same name (``sum(kestrel_replica_steps_total) == kestrel_steps_total``).

The prefix cache's counters are the exception: read at each scrape they
would tell a client whether its last request reused a cached prefix, an
answer about other clients' prompts.  They are published as they were at
the start of the current PREFIX_WINDOW_S window, so one scrape shows a
minute's reuse, not a request's.
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from scheduler.step_log import TTFT_BUCKETS_S

PREFIX_WINDOW_S = 60.0
PREFIX_COUNTERS = (("prefix_hits", "prompts that reused a cached prefix"),
                   ("prefix_misses", "prompts that found no cached prefix"),
                   ("prefix_reused_tokens", "prompt tokens taken from the prefix cache instead of computed"))
# (kind, key of Service.stats(), metric, help, scale): the admission queue in front of the sessions
ADMISSION = (
    ("gauge", "admission_queue_depth", "kestrel_admission_queue_depth", "generations waiting for a session", 1),
    ("gauge", "admission_max_queue", "kestrel_admission_max_queue", "--max-queue", 1),
    ("counter", "admission_waited", "kestrel_admission_waited", "generations that waited for a session, then got one",
     1),
    ("counter", "admission_wait_s", "kestrel_admission_wait_seconds", "time generations waited for a session, in all "
     "(divide by kestrel_admission_waited_total for the mean)", 1),
    ("gauge", "admission_max_wait_ms", "kestrel_admission_max_wait_seconds", "the longest wait for a session", 1e-3),
    ("counter", "admission_left_while_queued", "kestrel_admission_left_while_queued",
     "generations whose client left while they waited", 1),
    ("counter", "admission_refused_queue_full", "kestrel_admission_refused",
     "generations refused (429) because the queue was full", 1),
)
SPEC_COUNTERS = (("spec_drafted", "drafted_tokens", "tokens drafted by speculative rounds"),
                 ("spec_accepted", "accepted_tokens", "drafted tokens the model kept"),
                 ("spec_passes", "passes", "model passes of speculative generations (with or without drafts)"),
                 ("spec_plain_passes", "plain_passes", "of those, passes the cost model ran without drafts"),
                 ("spec_refused", "refused", "generations that decoded plainly: no room for one more draft stream"))
SPEC_GAUGES = (("spec_acceptance", "acceptance", "drafted tokens kept, over drafted tokens"),
               ("spec_tokens_per_pass", "tokens_per_pass", "tokens emitted per model pass of speculative generations"),
               ("spec_draft_length", "draft_length", "mean drafted tokens per drafting pass (a tree: its depth)"),
               ("spec_tree_nodes", "tree_nodes", "mean tokens per drafting pass: a tree's nodes (a chain of k: k + 1)"))
# (kind, key of a replica's stats, name after kestrel_replica_, help): each replica's figures, labelled
REPLICA = (
    ("gauge", "sessions", "sessions", "open sessions"),
    ("gauge", "load", "load", "sessions held and requests queued: what the router balances"),
    ("counter", "placed", "placed_sessions", "sessions the router placed on the replica"),
    ("counter", "placed_by_prefix", "placed_by_prefix", "of those, placed there for a cached prefix of the prompt "
     "over a less loaded replica"),
    ("counter", "steps", "steps", "engine steps the batcher formed"),
    ("counter", "decode_steps", "decode_steps", "engine steps with decode tokens"),
    ("counter", "decode_step_s", "decode_step_seconds", "engine time of the decode steps"),
    ("counter", "decode_tokens", "decode_tokens", "decode tokens run in steps"),
    ("counter", "prompt_tokens", "prompt_tokens", "prompt tokens run in steps"),
    ("counter", "step_errors", "step_errors", "requests whose step failed on the replica"),
    ("gauge", "queue_depth", "queue_depth", "jobs waiting in the batcher"),
    ("gauge", "kv_positions_used", "kv_positions_used", "KV cache positions filled in open sessions"),
    ("gauge", "kv_positions_allocated", "kv_positions_allocated", "KV cache positions of open sessions"),
)


class Metrics:
    def __init__(self, service, clock=time.monotonic):
        """clock: seconds, for the prefix counters' window."""
        self.registry = CollectorRegistry()
        self.requests = Counter("kestrel_http_requests", "HTTP requests by path and status",
                                ["path", "status"], registry=self.registry)
        self.prompt_tokens = Counter("kestrel_http_prompt_tokens", "prompt tokens of HTTP generations",
                                     registry=self.registry)
        self.completion_tokens = Counter("kestrel_http_completion_tokens", "tokens generated for HTTP requests",
                                         registry=self.registry)
        self.ttft = Histogram("kestrel_http_time_to_first_token_seconds", "from the request's start to its "
                              "first token", buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.registry.register(DaemonCollector(service, clock))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class DaemonCollector:
    """The daemon's stats (both transports) as metric families, read at scrape time."""

    def __init__(self, service, clock=time.monotonic):
        self.service, self.clock = service, clock
        self.prefix_published: dict = {}
        self.prefix_published_at: float | None = None

    def prefix_counters(self, stats: dict) -> dict:
        """The prefix counters as of the start of the current window: the totals', and each replica's under its
        index."""
        now = self.clock()
        if self.prefix_published_at is None or now - self.prefix_published_at >= PREFIX_WINDOW_S:
            def published(current: dict) -> dict:
                return {key: current[key] for key, _ in PREFIX_COUNTERS if key in current}
            self.prefix_published = {None: published(stats.get("prefix_cache") or {}), **{
                replica["replica"]: published(replica.get("prefix_cache") or {})
                for replica in stats.get("replicas", [])}}
            self.prefix_published_at = now
        return self.prefix_published

    def collect(self):
        service = self.service
        stats = service.stats()
        counters = stats.get("counters", {})

        def counter(name, doc, value):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], float(value))
            return family

        def gauge(name, doc, value):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            return family
        yield counter("kestrel_daemon_requests", "daemon requests over the socket transports", stats["requests"])
        yield counter("kestrel_daemon_errors", "daemon requests answered with an error", stats["errors"])
        yield counter("kestrel_steps", "engine steps the batcher formed", stats.get("steps", 0))
        yield counter("kestrel_decode_steps", "engine steps with decode tokens", stats["decode_steps"])
        yield counter("kestrel_decode_step_seconds", "engine time of the decode steps (divide by "
                      "kestrel_decode_steps_total for the mean step time)", stats["decode_step_s"])
        yield counter("kestrel_decode_tokens", "decode tokens run in steps (both transports)",
                      stats.get("decode_tokens", 0))
        yield counter("kestrel_prompt_tokens", "prompt tokens run in steps (both transports)",
                      stats.get("prompt_tokens", 0))
        yield gauge("kestrel_mean_batch", "mean sessions per batched step", stats.get("mean_batch", 0.0))
        yield gauge("kestrel_tokens_per_step", "mean tokens per engine step", stats.get("tokens_per_step", 0.0))
        yield gauge("kestrel_queue_depth", "jobs waiting in the batcher", stats.get("queue_depth", 0))
        for kind, key, name, doc, scale in ADMISSION:
            yield (gauge if kind == "gauge" else counter)(name, doc, stats.get(key, 0) * scale)
        yield gauge("kestrel_sessions", "open sessions", stats["sessions"])
        yield gauge("kestrel_max_sessions", "--max-sessions", stats["max_sessions"])
        ttft = stats.get("ttft_ms") or {}
        for key in ("p50", "p99"):
            if isinstance(ttft.get(key), (int, float)):
                yield gauge(f"kestrel_ttft_{key}_seconds", f"time to first token, {key} of the daemon's prompts",
                            ttft[key] / 1e3)
            if isinstance(ttft.get(f"steps_{key}"), (int, float)):
                yield gauge(f"kestrel_ttft_steps_{key}", f"steps a prompt took to its first token (formed from its "
                            f"arrival, its own included), {key}", ttft[f"steps_{key}"])
        for key, name, doc in (("ttft_histogram", "kestrel_ttft_seconds", "time to first token of every prompt "
                                "since the start, from its arrival at the daemon"),
                               ("ttft_steps_histogram", "kestrel_ttft_steps", "steps a prompt took to its first "
                                "token (formed from its arrival, its own included), every prompt since the start")):
            hist = stats.get(key)
            if hist:
                yield HistogramMetricFamily(name, doc, buckets=list(hist["le"].items()), sum_value=hist["sum"])
        steps = stats.get("step_ms") or {}
        for key in ("p50", "p99", "max"):
            if isinstance(steps.get(key), (int, float)) and steps.get("samples"):
                yield gauge(f"kestrel_step_{key}_seconds", f"an engine step's run time, {key} of the latest "
                            f"steps", steps[key] / 1e3)
        yield gauge("kestrel_kv_positions_used", "KV cache positions filled in open sessions",
                    stats.get("kv_positions_used", 0))
        yield gauge("kestrel_kv_positions_allocated", "KV cache positions of open sessions",
                    stats.get("kv_positions_allocated", 0))
        for key in ("window_hits", "window_misses"):
            if key in counters:
                yield counter(f"kestrel_{key}", f"weight window {key.split('_')[1]} (offloaded modes)", counters[key])
        kv = stats.get("kv") or {}          # the device's paged KV pool; the host engines keep a cache per session
        for key, doc in (("kv_blocks_used", "KV pool blocks held by open sessions"),
                         ("kv_blocks_cached", "KV pool blocks holding cached prompt prefixes"),
                         ("kv_blocks_max", "KV pool blocks in all"), ("kv_bytes_used", "KV pool bytes in use")):
            if key in kv:
                yield gauge(f"kestrel_{key}", doc, kv[key])
        prefix = self.prefix_counters(stats)
        for key, doc in PREFIX_COUNTERS:
            if key in prefix[None]:
                yield counter(f"kestrel_{key}", f"{doc} (as of the start of the current minute)", prefix[None][key])
        spec = stats.get("speculation")     # with a draft (serve -md / --spec lookup)
        if spec is not None:
            for key, name, doc in SPEC_COUNTERS:
                yield counter(f"kestrel_spec_{name}", doc, spec[key])
            for key, name, doc in SPEC_GAUGES:
                yield gauge(f"kestrel_spec_{name}", doc, spec[key])
        yield from self.replica_families(stats.get("replicas", []), prefix)

    def replica_families(self, replicas: list[dict], prefix: dict):
        """Each replica's figures under its ``replica`` and ``device`` labels."""
        if not replicas:
            return
        count = GaugeMetricFamily("kestrel_replicas", "engines serving (serve --devices), one replica each")
        count.add_metric([], float(len(replicas)))
        yield count
        labels = ["replica", "device"]
        for kind, key, name, doc in REPLICA:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                f"kestrel_replica_{name}", doc, labels=labels)
            for replica in replicas:
                family.add_metric([str(replica["replica"]), replica["device"]], float(replica.get(key, 0)))
            yield family
        for key, doc in PREFIX_COUNTERS:
            family = CounterMetricFamily(f"kestrel_replica_{key}", f"{doc} (as of the start of the current minute)",
                                         labels=labels)
            for replica in replicas:
                published = prefix.get(replica["replica"], {})
                if key in published:
                    family.add_metric([str(replica["replica"]), replica["device"]], float(published[key]))
            if family.samples:
                yield family
