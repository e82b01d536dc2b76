"""Prometheus metrics of a serving process (own registry, so tests can run several servers).

Histograms are observed by the engine loop as outputs leave it (``observe_output``):
time to first token, inter-token latency (a chunk of k tokens after a gap g counts k gaps
of g/k), end-to-end latency. Gauges and counters that the engine already keeps (running /
waiting requests, KV pages used, preemptions, compilations, steps) are read at scrape time
from the snapshot the engine thread publishes after each step (a scrape never waits on a step).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("k3serve_time_to_first_token_seconds", "Submit to first generated token", buckets=_LAT,
                              registry=r)
        self.itl = Histogram("k3serve_inter_token_latency_seconds", "Gap between generated tokens", buckets=_LAT,
                             registry=r)
        self.e2e = Histogram("k3serve_e2e_request_latency_seconds", "Submit to finish", buckets=_LAT + (300,),
                             registry=r)
        self.finished = Counter("k3serve_requests_finished", "Finished requests by reason", ["reason"], registry=r)
        self.rejected_c = Counter("k3serve_requests_rejected", "Refused requests by gRPC status", ["code"], registry=r)
        self.prompt_tokens = Counter("k3serve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.gen_tokens = Counter("k3serve_generation_tokens", "Generated tokens", registry=r)
        self.loop = None
        self.pd = None  # the P/D side (pd.prefill.PrefillSide / pd.decode.DecodeSide) of a --role server
        r.register(_EngineCollector(self))
        self._http = None

    def observe_output(self, handle, out, now: float) -> None:
        k = len(out.new_token_ids)
        if k:
            self.gen_tokens.inc(k)
            if handle.first_token_at == now and handle.last_token_at is None:
                self.ttft.observe(now - handle.submitted)
                k -= 1
                prev = now
            else:
                prev = handle.last_token_at or handle.first_token_at or now
            for _ in range(k):
                self.itl.observe((now - prev) / max(1, len(out.new_token_ids)))
        if out.finished:
            self.e2e.observe(now - handle.submitted)
            self.finished.labels(out.finish_reason or "abort").inc()
            self.prompt_tokens.inc(out.prompt_tokens)

    def rejected(self, code: str) -> None:
        self.rejected_c.labels(code).inc()

    def serve_http(self, host: str = "127.0.0.1", port: int = 9090):
        """Expose /metrics; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http = None


class _EngineCollector:
    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        yield from self._pd()
        loop = self.m.loop
        if loop is None:
            return
        st = loop.stats()
        eng = loop.engine
        g = lambda name, doc, v: GaugeMetricFamily(name, doc, value=v)
        yield g("k3serve_requests_running", "Requests holding a KDA slot", st["running"])
        yield g("k3serve_requests_waiting", "Requests queued", st["waiting"])
        cached = st.get("prefix_pages_held", 0)
        yield g("k3serve_kv_pages_used", "MLA KV pages held by at least one request (shared cached pages "
                "included; pages only the prefix cache holds apart)", st["request_pages"])
        yield g("k3serve_kv_pages_total", "MLA KV pages", eng.capacity_plan.num_pages)
        yield g("k3serve_kda_slots_free", "Free KDA state slots", st["free_slots"])
        yield CounterMetricFamily("k3serve_preemptions", "Requests preempted (recomputed later)",
                                  value=st["num_preemptions"])
        yield CounterMetricFamily("k3serve_compilations", "Traces of the step function (compiles)",
                                  value=st["num_compiles"])
        yield CounterMetricFamily("k3serve_engine_steps", "Engine steps", value=st["num_steps"])
        counts = st.get("spec_accept_counts") or []
        if len(counts) > 1:  # speculative decoding: decode rows with drafts, by drafts accepted
            cum, buckets = 0, []
            for a, n in enumerate(counts):
                cum += n
                buckets.append((str(a), cum))
            buckets.append(("+Inf", cum))
            yield HistogramMetricFamily("k3serve_spec_accepted_drafts", "Drafts accepted per speculative decode row",
                                        buckets=buckets, sum_value=st["spec_accepted_tokens"])
            yield CounterMetricFamily("k3serve_spec_draft_tokens", "Drafts verified", value=st["spec_draft_tokens"])
        if st.get("prefix_caching"):
            c = lambda name, doc, key: CounterMetricFamily(name, doc, value=st[key])
            yield c("k3serve_prefix_query_tokens", "Prompt tokens of admitted requests (prefix-cache lookups)",
                    "prefix_query_tokens")
            yield c("k3serve_prefix_kv_hit_tokens", "Tokens whose MLA rows came from shared cached pages",
                    "prefix_kv_hit_tokens")
            yield c("k3serve_prefix_state_hit_tokens", "Tokens skipped by resuming from a cached KDA state snapshot",
                    "prefix_state_hit_tokens")
            yield c("k3serve_prefix_snapshots_registered", "KDA state snapshots registered", "snapshots_registered")
            yield c("k3serve_prefix_snapshots_evicted", "KDA state snapshots evicted", "snapshots_evicted")
            yield g("k3serve_prefix_pages_cached", "MLA pages held only or also by the prefix cache", cached)
            yield g("k3serve_prefix_snapshots_held", "KDA state snapshots registered in the prefix cache",
                    st["snapshots_held"])
            tier = GaugeMetricFamily("k3serve_prefix_cache_bytes", "Bytes the prefix cache holds, by tier",
                                     labels=["tier"])
            tier.add_metric(["device"], st["prefix_device_bytes"])
            tier.add_metric(["host"], st.get("prefix_host_bytes", 0))
            yield tier

    def _pd(self):
        """The P/D handoffs this server took part in (``--role``): counters of the side."""
        side = self.m.pd
        c = lambda name, doc, v: CounterMetricFamily(name, doc, value=v)  # noqa: E731
        if hasattr(side, "rooms"):  # prefill
            yield c("k3serve_pd_handoffs_staged", "P/D handoffs computed and staged for a decode", side.rooms.handoffs)
            yield c("k3serve_pd_stage_seconds", "Prompt done to pieces staged, summed", side.rooms.stage_s)
        elif hasattr(side, "bytes_received"):  # decode
            yield c("k3serve_pd_handoffs_received", "P/D handoffs pulled and delivered to the engine", side.handoffs)
            yield c("k3serve_pd_received_bytes", "Bytes of the pieces of those handoffs", side.bytes_received)
            yield c("k3serve_pd_pull_seconds", "Pull start to every piece here, summed", side.transfer_time_s)
        budget = getattr(side, "budget", None)
        if budget is not None:  # handoff memory (--pd-handoff-memory-gb), per process of the side
            for name, doc, values in (
                    ("k3serve_pd_handoff_memory_bytes", "Device bytes P/D handoffs hold now, by process of the side",
                     budget.in_use_per_process),
                    ("k3serve_pd_handoff_memory_peak_bytes", "Most device bytes P/D handoffs held at once, by process",
                     budget.peak_per_process)):
                fam = GaugeMetricFamily(name, doc, labels=["process"])
                for p, v in enumerate(values):
                    fam.add_metric([str(p)], v)
                yield fam
            if budget.limit is not None:
                yield GaugeMetricFamily("k3serve_pd_handoff_memory_limit_bytes",
                                        "The bound on handoff bytes per process (--pd-handoff-memory-gb)",
                                        value=budget.limit)
