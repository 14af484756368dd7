"""Prometheus sink for the server's plain-data statistics (vLLM spec-decode names, ``dspark:`` prefix).

One private :class:`CollectorRegistry` per app, so tests that build several apps never collide. The
engine and the drafter manager call the ``observe_*`` methods with plain numbers; nothing else in the
server touches prometheus_client.
"""

from __future__ import annotations

import prometheus_client as prom
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

prom.disable_created_metrics()       # no *_created series next to every counter (stack-notes 5.2)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = prom.CONTENT_TYPE_LATEST


class ServingMetrics:
    """All series of one server. Label ``domain`` everywhere a request's domain is known."""

    def __init__(self, max_block: int = 16):
        self.registry = r = CollectorRegistry()
        p = "dspark:"
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Speculative rounds that drafted at least one token",
                                  ["domain"], registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        ["domain"], registry=r)
        self.num_verified_tokens = Counter(p + "spec_decode_num_verified_tokens",
                                           "Draft tokens sent to the target for verification (after the "
                                           "verify-length policy)", ["domain"], registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           ["domain"], registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position (0-based)",
                                        ["domain", "position"], registry=r)
        self.shadow_rounds = Counter(p + "spec_decode_num_shadow_rounds",
                                     "Rounds that verified the whole drafted block (shadow verification)",
                                     ["domain"], registry=r)
        self.verify_length = Histogram(p + "spec_decode_verify_length", "Draft tokens verified per round",
                                       ["domain"], buckets=tuple(range(0, max_block + 1)), registry=r)
        self.token_budget = Gauge(p + "scheduler_token_budget",
                                  "Tokens in the last verify forward (anchors + verified drafts)", registry=r)
        self.sps_in_use = Gauge(p + "scheduler_sps", "SPS(B) (engine steps/s) the scheduler assumed for the last "
                                "step's verify batch", registry=r)
        self.sps_rows = Gauge(p + "scheduler_sps_table_rows", "Concurrency of the SPS(B) table in use", registry=r)
        self.speculating = Gauge(p + "scheduler_speculating", "1 if the live gate ran the last step with "
                                 "speculation, 0 if it decoded plainly (faster at this load)", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for a batch slot", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", ["domain"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time per output token after the first (a chunk "
                             "of n tokens arriving after t seconds counts n times t/n)", ["domain"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish", ["domain"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram(p + "engine_step_seconds", "Wall time of one engine step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled", ["domain"], registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", ["domain"], registry=r)
        self.requests = Counter(p + "request_success", "Finished requests by finish reason",
                                ["domain", "finish_reason"], registry=r)
        self.engine_errors = Counter(p + "engine_errors", "Engine steps or prefills that raised", registry=r)
        self.swaps = Counter(p + "drafter_swaps", "Drafter swaps applied between engine steps",
                             ["domain", "reason"], registry=r)
        self.rollbacks = Counter(p + "drafter_rollbacks", "Drafter rollbacks (manual or canary)",
                                 ["domain", "reason"], registry=r)
        self.active_version = Gauge(p + "drafter_active_version", "Registry version of the drafter in use "
                                    "(0 = unversioned local checkpoint, -1 = no speculation)", ["domain"], registry=r)
        self.live_acceptance = Gauge(p + "drafter_live_acceptance", "Accepted / drafted over the live window",
                                     ["domain"], registry=r)
        self.live_cal_ece = Gauge(p + "live_calibration_ece", "ECE of the predicted prefix survival over the live "
                                  "calibrator's window, by draft position (1-based) and calibration (raw, shipped, "
                                  "live)", ["domain", "position", "calibration"], registry=r)
        self.live_cal_rounds = Gauge(p + "live_calibration_window_rounds", "Fully verified rounds in the live "
                                     "calibrator's window", ["domain"], registry=r)
        self.live_cal_version = Gauge(p + "live_calibration_version", "Live refits in use since the drafter was "
                                      "loaded (0 = its shipped calibration)", ["domain"], registry=r)
        self.live_cal_refits = Counter(p + "live_calibration_refits", "Live refits accepted", ["domain"], registry=r)
        self.live_cal_refusals = Counter(p + "live_calibration_refusals", "Live refits refused (too few rounds, or "
                                         "worse than the shipped calibration on held-back rounds)",
                                         ["domain", "reason"], registry=r)
        self.poll_errors = Counter(p + "registry_poll_errors", "Registry alias polls that failed", registry=r)
        self.traces_written = Counter(p + "trace_records_written", "Trace records appended to landing files",
                                      registry=r)
        self.traces_dropped = Counter(p + "trace_records_dropped", "Trace records dropped (buffer full or write "
                                      "error)", registry=r)
        self.traces_invalid = Counter(p + "trace_records_invalid", "Trace records that failed validation where "
                                      "the engine built them (a bug: not written; the request was answered)",
                                      registry=r)

    # ---- sinks called by the engine and the drafter manager ----------------------------------------
    def observe_round(self, domain: str, drafted: int, verified: int, accepted: int, full_verify: bool) -> None:
        if drafted <= 0:
            return
        self.num_drafts.labels(domain).inc()
        self.num_draft_tokens.labels(domain).inc(drafted)
        self.num_verified_tokens.labels(domain).inc(verified)
        self.num_accepted_tokens.labels(domain).inc(accepted)
        for pos in range(accepted):
            self.accepted_per_pos.labels(domain, str(pos)).inc()
        self.verify_length.labels(domain).observe(verified)
        if full_verify:
            self.shadow_rounds.labels(domain).inc()

    def observe_step(self, seconds: float, budget: int, sps: float | None, rows: int | None) -> None:
        self.step_seconds.observe(seconds)
        self.token_budget.set(budget)
        if sps is not None:
            self.sps_in_use.set(sps)
        if rows is not None:
            self.sps_rows.set(rows)

    def observe_tokens(self, domain: str, n: int, since_last: float | None, first_latency: float | None) -> None:
        if first_latency is not None:
            self.ttft.labels(domain).observe(first_latency)
        if since_last is not None and n > 0:
            per = since_last / n
            for _ in range(n):
                self.itl.labels(domain).observe(per)
        if n > 0:
            self.generation_tokens.labels(domain).inc(n)

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)
