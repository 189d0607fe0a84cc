"""``GET /metrics``: the server's Prometheus metrics, named after vLLM's
(``vllm:num_requests_running`` is ``paged_jax:num_requests_running`` here).

Two sources, one registry per app (so two apps in one process, as in the
tests, never share a counter):

- the engine's own counters and page accounting, read from the latest
  :class:`server.engine_loop.EngineSnapshot` by a custom collector at
  scrape time: they are totals the engine keeps anyway
  (:class:`paged_jax.engine.stats.EngineStats`), so mirroring them into
  prometheus counters step by step would only add work to the loop;
- per-request latencies (time to first token, every inter-token gap,
  end to end) and finished requests by reason, observed on the loop's
  thread from each output as it is reported (:meth:`ServerMetrics.observe`).

Times are seconds on the engine's clock (:meth:`paged_jax.engine.core.Engine.clock`):
from a request's admission by the engine, not from the client's send.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from paged_jax.engine.requests import RequestOutput
from server.engine_loop import EngineSnapshot

PREFIX = "paged_jax:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
"""Histogram buckets in seconds (vLLM's)."""


class _EngineCollector(Collector):
    """The engine's counters and gauges from the latest snapshot."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None], model_name: str):
        self._snapshot = snapshot
        self._model = model_name

    def collect(self):
        s = self._snapshot()
        if s is None:
            return
        labels = ["model_name"]
        value = [self._model]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Requests with sequences in the running batch.", s.requests_running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted (preempted ones included).",
                    s.requests_waiting)
        yield gauge("num_seqs_running", "Sequences in the running batch (a request with n > 1 runs n).",
                    s.seqs_running)
        pages = GaugeMetricFamily(PREFIX + "kv_cache_pages",
                                  "KV pages by state: free, cached (no holder, kept for the prefix cache), used "
                                  "(held by a sequence); free + cached + used = total usable pages.",
                                  labels=labels + ["state"])
        for state, v in (("free", s.pages_free), ("cached", s.pages_cached), ("used", s.pages_used)):
            pages.add_metric(value + [state], v)
        yield pages
        yield gauge("kv_cache_pages_total", "Usable KV pages (the null page excluded).", s.pages_total)
        yield gauge("kv_cache_usage_perc", "Share of usable KV pages held by sequences (1 = full).",
                    s.pages_used / s.pages_total if s.pages_total else 0.0)
        yield counter("prompt_tokens", "Prompt tokens of requests, counted at their first admission.",
                      s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prompt_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hit_tokens)
        by_tier = CounterMetricFamily(PREFIX + "prefix_cache_hits_by_tier",
                                      "Prompt tokens served from the prefix cache, by the tier that held them "
                                      "(device: the KV pool; host, disk: loaded back from host memory, from "
                                      "disk; remote: loaded from another engine by the KV connector).",
                                      labels=labels + ["tier"])
        tiers = {t: s.tiers.get(t, {}) for t in ("host", "disk", "remote")}
        by_tier.add_metric(value + ["device"], s.prefix_hit_tokens - sum(t.get("hit_tokens", 0)
                                                                          for t in tiers.values()))
        for name, t in tiers.items():
            by_tier.add_metric(value + [name], t.get("hit_tokens", 0))
        yield by_tier
        for unit in ("pages", "bytes"):
            moved = CounterMetricFamily(PREFIX + f"kv_tier_{unit}_moved",
                                        f"KV {unit} moved between the device pool and a tier: spilled (to the host "
                                        "tier when the pool evicts a cached page, to the disk tier and a KV "
                                        "producer's store once computed) and loaded (a hit brought back).",
                                        labels=labels + ["tier", "direction"])
            for name, t in tiers.items():
                moved.add_metric(value + [name, "spilled"], t.get(f"spilled_{unit}", 0))
                moved.add_metric(value + [name, "loaded"], t.get(f"loaded_{unit}", 0))
            yield moved
        for kind, doc in (("used", "holds"), ("capacity", "may hold (--host-cache-gib, --disk-cache-gib, a KV "
                                                         "producer's --kv-buffer-gib)")):
            g = GaugeMetricFamily(PREFIX + f"kv_tier_{kind}_bytes", f"Bytes of K/V each tier {doc}.",
                                  labels=labels + ["tier"])
            for name, t in tiers.items():
                g.add_metric(value + [name], t.get(f"{kind}_bytes", 0))
            yield g
        saved = CounterMetricFamily(PREFIX + "kv_tier_saved_seconds",
                                    "An estimate of the prefill seconds each tier's hits saved: prompt tokens it "
                                    "served times the engine's model seconds per token in its prefilling calls "
                                    "(loads not subtracted).", labels=labels + ["tier"])
        for name, t in tiers.items():
            saved.add_metric(value + [name], t.get("saved_s", 0.0))
        yield saved
        yield counter("kv_tier_refused_files", "Disk tier files refused when read (short, corrupted, another "
                      "model's, or gone): never served.", tiers["disk"].get("refused_files", 0))
        yield counter("kv_transfer_refused_lookups", "KV connector lookups that brought nothing: the producer "
                      "refused (another model's pages), did not answer, or failed a check.",
                      tiers["remote"].get("refused_lookups", 0))
        yield counter("num_preemptions", "Preemptions (recompute or swap).", s.preemptions)
        yield counter("engine_iterations", "Engine scheduler iterations.", s.iterations)
        yield counter("compile_seconds", "Seconds JAX spent tracing, lowering and compiling (or loading from the "
                      "persistent cache) since the server started.", s.compile_seconds)
        yield counter("spec_decode_num_drafts", "Speculative decoding: a sequence's proposals verified in a call.",
                      s.spec_drafts)
        yield counter("spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed and verified.",
                      s.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.",
                      s.spec_accepted_tokens)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: accepted tokens by position in the proposal (0 first).",
                                      labels=labels + ["position"])
        for pos, v in enumerate(s.spec_accepted_by_position):
            per_pos.add_metric(value + [str(pos)], v)
        yield per_pos
        yield counter("xla_compilations", "XLA programs requested (compiled or loaded from the persistent cache) "
                      "since the server started.", s.compilations)


class ServerMetrics:
    """The app's metrics registry.

    Args:
      snapshot: returns the engine's latest snapshot (None: not started).
      model_name: the ``model_name`` label (the served model's name).
    """

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot, model_name))
        labels = ["model_name"]
        self._model = model_name
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by the reason their first choice ended (stop, length, "
            "abort: the client went away).", labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from a request's admission to its first token, engine clock.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive tokens of a choice, engine clock.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from a request's admission to its end, engine clock.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._first_seen: set = set()  # request ids whose first token was observed
        self._last_token: dict = {}  # request_id -> {choice index: its last token's time}

    def observe(self, out: RequestOutput) -> None:
        """Records one output's news (a "delta" report, or an aborted
        request's last one). Runs on the engine loop's thread."""
        rid = out.request_id
        if out.first_token_s is not None and rid not in self._first_seen:
            self._first_seen.add(rid)
            self.ttft.observe(max(out.first_token_s - out.arrival_s, 0.0))
        lasts = self._last_token.setdefault(rid, {})
        for c in out.outputs:
            last = lasts.get(c.index)
            for t in c.token_times:
                if last is not None:
                    self.itl.observe(max(t - last, 0.0))
                last = t
            if last is not None:
                lasts[c.index] = last
            if c.index == 0 and c.finish_reason is not None:
                self.request_success.labels(self._model, c.finish_reason).inc()
        if out.finished:
            if out.finish_s is not None:
                self.e2e.observe(max(out.finish_s - out.arrival_s, 0.0))
            self._first_seen.discard(rid)
            self._last_token.pop(rid, None)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
