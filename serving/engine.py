"""The engine thread: continuous-batching DSpark decoding around :class:`dspark_core.engine.spec_batch.SpecBatch`.

One thread owns the batch, its KV cache and every request's decoding state. HTTP handlers talk to it only
through :meth:`Engine.submit` / :meth:`Engine.cancel` / :meth:`Engine.call` (a thread-safe inbox) and get
:class:`Event` objects back through the ``emit`` callback they pass in (which hops onto their asyncio
loop). Per loop turn: apply inbox commands (swaps run here, between steps), admit waiting requests
(prefill) up to ``max_batch``, run one speculative step with the load-aware policy, stream each
request's new text, finish requests (stop token, stop string, length, cancel), hand their trace records
to the writer. An exception in a step fails only the requests in that batch; the loop keeps serving.

A finished request's :class:`~dspark_core.data.traces.TraceRecord` is built here, after the request was
answered, so an invalid record (a bug in this engine) fails where it is made: it is logged at ERROR,
counted in ``dspark:trace_records_invalid_total`` and not written, while the request keeps its answer
and the batch keeps running. The writer's "dropped" count is left to a full buffer or a disk error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from dspark_core.data.traces import RoundStat, TraceFormatError, TraceRecord, prompt_id_of, utc_now_iso
from dspark_core.engine.inputs import make_generator
from dspark_core.engine.policy import VerifyPolicy, check_policy
from dspark_core.engine.sampling import SamplingParams
from dspark_core.engine.spec_batch import SpecBatch, SpecRequest

from .drafters import LoadedDrafter
from .manager import DrafterManager
from .metrics import ServingMetrics

log = logging.getLogger("dspark.serving.engine")
_IDLE_RESET_TOKENS = 2048        # an idle batch whose cache grew past this is rebuilt (frees memory)


def _malloc_trim():
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS): returns freed heap pages to the system."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


@dataclass
class Event:
    """One chunk for one request. The last one has ``finish_reason`` (or ``error``) and ``usage``."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    usage: dict | None = None
    info: dict | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class GenRequest:
    request_id: str
    domain: str
    prompt_ids: list[int]
    prompt_text: str                       # for the trace record's prompt_id
    params: SamplingParams
    seed: int
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class _Track:
    req: GenRequest
    spec: SpecRequest
    drafter: LoadedDrafter | None
    rounds: list[dict] = field(default_factory=list)
    sent_tokens: int = 0
    text: str = ""                         # text emitted so far
    stopped_text: str | None = None        # final text when a stop string matched
    stable: str = ""                       # decoded text of tokens[:read_off] (incremental detokenizing)
    prefix_off: int = 0                    # tokens[prefix_off:read_off] give the next piece its context
    read_off: int = 0
    t_last: float | None = None
    calibration: dict | None = None        # the calibration that sizes this request's rounds (trace record)


class Engine:
    # 10 parameters: the server's parts, each built on its own and wired together once by build_server
    def __init__(self, runner, tokenizer, manager: DrafterManager, policy: VerifyPolicy, metrics: ServingMetrics,
                 target_fingerprint: str, max_batch: int = 8, shadow_fraction: float = 0.0,
                 trace_sink: Callable[[TraceRecord], bool] | None = None, sps_tables: dict | None = None,
                 trim_interval: float = 30.0):
        self.runner, self.tokenizer, self.manager = runner, tokenizer, manager
        self.policy: VerifyPolicy = check_policy(policy)
        self.metrics, self.fingerprint = metrics, target_fingerprint
        self.max_batch, self.shadow_fraction = max_batch, shadow_fraction
        self.trace_sink, self.sps_tables = trace_sink, sps_tables or {}
        # glibc keeps freed heap pages (a swapped-out drafter's weights, request churn) and RSS creeps up by
        # the size of each swap; trimming at a step boundary every trim_interval seconds returns them
        self.trim_interval, self._last_trim = trim_interval, time.monotonic()
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[GenRequest] = deque()
        self._tracks: dict[str, _Track] = {}
        self._batch_seed = 0
        self.batch = self._new_batch()
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._stopping = False
        self.steps = 0
        manager.attach_engine(self.call)

    # ---- thread-safe API ---------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: GenRequest) -> None:
        self._inbox.put(("submit", req))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def call(self, fn: Callable, timeout: float = 120.0):
        """Run ``fn`` on the engine thread between two steps and return its result."""
        if not self.alive or threading.current_thread() is self._thread:
            return fn()
        box: dict = {}
        done = threading.Event()
        self._inbox.put(("call", fn, box, done))
        if not done.wait(timeout):
            raise TimeoutError("the engine did not reach a step boundary in time")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def stop(self, timeout: float = 30.0) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    def load(self) -> dict:
        return {"running": len(self.batch.active), "waiting": len(self._waiting)}

    def queued(self) -> int:
        """Requests submitted but not yet in the batch (in the inbox or waiting for a slot); approximate
        from another thread, which is all admission control needs."""
        return self._inbox.qsize() + len(self._waiting)

    # ---- loop --------------------------------------------------------------------------------------
    def _new_batch(self) -> SpecBatch:
        self._batch_seed += 1
        return SpecBatch(self.runner, shadow_fraction=self.shadow_fraction, seed=self._batch_seed)

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._drain(block=not self.batch.active and not self._waiting)
                if self._stopping:
                    break
                self._admit()
                if self.batch.active:
                    self._step()
                self._finish_done()
            except Exception:                       # never let the engine thread die
                log.error("engine loop error:\n%s", traceback.format_exc())
                self.metrics.engine_errors.inc()
                self._fail_all("internal engine error; the request was aborted")
            self.metrics.running.set(len(self.batch.active))
            self.metrics.waiting.set(len(self._waiting))
            self._maybe_trim()
        self._fail_all("the server is shutting down")
        for req in list(self._waiting):
            self._emit(req, Event(error="the server is shutting down"))
        self._waiting.clear()

    def _maybe_trim(self) -> None:
        if _TRIM is None or self.trim_interval <= 0 or time.monotonic() - self._last_trim < self.trim_interval:
            return
        self._last_trim = time.monotonic()
        _TRIM(0)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = item[0]
            if kind == "submit":
                self._waiting.append(item[1])
            elif kind == "cancel":
                self._cancel(item[1])
            elif kind == "call":
                _, fn, box, done = item
                try:
                    box["result"] = fn()
                except Exception as e:
                    box["error"] = e
                done.set()
            elif kind == "stop":
                self._stopping = True
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, request_id: str) -> None:
        for req in list(self._waiting):
            if req.request_id == request_id:
                self._waiting.remove(req)
                self.metrics.requests.labels(req.domain, "abort").inc()
                return
        tr = self._tracks.get(request_id)
        if tr is not None and tr.spec.finish_reason is None:
            tr.spec.finish_reason = "abort"

    def _admit(self) -> None:
        while self._waiting and len(self.batch.active) < self.max_batch:
            req = self._waiting.popleft()
            drafter = self.manager.current(req.domain)
            calibrate, cal_info, live = _calibration_of(drafter)
            adapt = drafter.live.request_offset() if live else None
            try:                                   # a bad request fails alone, whatever in it is bad
                gen = make_generator(req.seed, self.runner.device)
                spec = SpecRequest(req.request_id, req.prompt_ids, req.params,
                                   drafter.proposer if drafter is not None else None, gen,
                                   calibrate, record_rounds=True, record_confidences=live, adapt=adapt)
                self.batch.add(spec)               # a failed prefill leaves the batch as it was
            except Exception as e:
                log.error("admission failed for %s: %s", req.request_id, e)
                self.metrics.engine_errors.inc()
                self._emit(req, Event(error=f"prefill failed: {e}"))
                continue
            self.metrics.prompt_tokens.labels(req.domain).inc(len(req.prompt_ids))
            tr = _Track(req, spec, drafter, calibration=cal_info)
            self._tracks[req.request_id] = tr
            if spec.finish_reason is None:
                self._progress(tr)

    def _step(self) -> None:
        for live in self.manager.live_calibrators():     # refits that finished: swapped in between steps
            live.apply_pending()
        t0 = time.perf_counter()
        rows = sum(r.finish_reason is None for r in self.batch.active)        # what the policy plans for
        before = sum(len(r.tokens) for r in self.batch.active)
        try:
            self.batch.step(self.policy)
        except Exception:
            log.error("engine step failed:\n%s", traceback.format_exc())
            self.metrics.engine_errors.inc()
            self._fail_all("engine step failed; the request was aborted")
            return
        dt = time.perf_counter() - t0
        self.steps += 1
        speculating = self.policy.speculating()     # read before observe, which closes the step
        if speculating is not None:                 # a live gate decides per step
            self.metrics.speculating.set(1 if speculating else 0)
        self.policy.observe(rows, sum(len(r.tokens) for r in self.batch.active) - before, dt)
        budget = 0
        for tr in list(self._tracks.values()):
            log_ = tr.spec.stats.round_log
            live = tr.drafter.live if tr.drafter is not None else None
            for rd in log_:
                if live is not None and rd["full_verify"] and rd["drafted"] > 0:
                    live.observe(rd.get("confidence_logits"), rd["accepted"], rd.get("survival"))
                rd = {k: rd[k] for k in ("drafted", "verified", "accepted", "full_verify")}
                tr.rounds.append(rd)
                budget += 1 + rd["verified"]
                if tr.drafter is not None and rd["drafted"] > 0:
                    self.metrics.observe_round(tr.req.domain, rd["drafted"], rd["verified"], rd["accepted"],
                                               rd["full_verify"])
                    self.manager.observe_round(tr.drafter, rd["drafted"], rd["accepted"])
            log_.clear()                            # keep memory flat: confidence lists are not needed
            if tr.spec.finish_reason is None:
                self._progress(tr)
        tbl_rows = min((r for r in self.sps_tables if r >= rows), default=max(self.sps_tables, default=None))
        sps = self.sps_tables[tbl_rows](max(budget, 1)) if tbl_rows is not None else None
        self.metrics.observe_step(dt, budget, sps, tbl_rows)

    # ---- streaming ---------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text_so_far(self, tr: _Track) -> str:
        """The decoded text of all generated tokens, decoding only the new ones each step (O(new tokens),
        not O(output)): the new tokens are decoded after a few already-decoded ones, whose text is cut
        off again, so word-initial spaces come out as in a whole decode. A piece that ends in a partial
        UTF-8 character is not folded into the stable text yet."""
        toks = tr.spec.tokens
        if len(toks) == tr.read_off:
            return tr.stable
        before = self._decode(toks[tr.prefix_off:tr.read_off])
        after = self._decode(toks[tr.prefix_off:])
        piece = after[len(before):] if after.startswith(before) else self._decode(toks[tr.read_off:])
        if not piece.endswith("\ufffd"):
            tr.stable += piece
            tr.prefix_off, tr.read_off = max(0, len(toks) - 4), len(toks)
            return tr.stable
        return tr.stable + piece

    def _delta(self, tr: _Track, final: bool) -> str:
        """New text since the last chunk. Holds back a trailing partial UTF-8 character and, when stop
        strings are set, any tail that could still grow into one; a matched stop string ends the request
        and is not returned (OpenAI semantics)."""
        if tr.stopped_text is not None:
            full = tr.stopped_text
        else:
            full = self._text_so_far(tr)
            stops = tr.req.stop
            if stops:
                longest = max(len(s) for s in stops)
                start = max(0, len(tr.text) - longest)
                hits = [i for i in (full.find(s, start) for s in stops) if i >= 0]
                if hits:
                    full = tr.stopped_text = full[:min(hits)]
                    if tr.spec.finish_reason is None:
                        tr.spec.finish_reason = "stop"
                    final = True
        limit = len(full)
        if not final:
            limit = len(full.rstrip("\ufffd"))
            if tr.req.stop and tr.stopped_text is None:
                limit = min(limit, len(full) - (max(len(s) for s in tr.req.stop) - 1))
        new = full[len(tr.text):max(limit, len(tr.text))]      # never resend or retract emitted text
        tr.text += new
        return new

    def _progress(self, tr: _Track) -> None:
        text = self._delta(tr, final=False)          # may end the request (stop string): still send the text
        ids = tr.spec.tokens[tr.sent_tokens:]
        if not ids and not text:
            return
        self._note_tokens(tr, len(ids))
        tr.sent_tokens = len(tr.spec.tokens)
        self._emit(tr.req, Event(text=text, token_ids=ids))

    def _note_tokens(self, tr: _Track, n: int) -> None:
        now = time.perf_counter()
        first = now - tr.req.arrival if tr.t_last is None else None
        since = None if tr.t_last is None else now - tr.t_last
        self.metrics.observe_tokens(tr.req.domain, n, since, first)
        tr.t_last = now

    def _finish_done(self) -> None:
        for spec in self.batch.remove_finished():
            tr = self._tracks.pop(spec.key)
            reason = spec.finish_reason
            text = self._delta(tr, final=True)
            ids = spec.tokens[tr.sent_tokens:]
            if ids:
                self._note_tokens(tr, len(ids))
            tr.sent_tokens = len(spec.tokens)
            usage = {"prompt_tokens": len(tr.req.prompt_ids), "completion_tokens": len(spec.tokens),
                     "total_tokens": len(tr.req.prompt_ids) + len(spec.tokens)}
            drafted = sum(r["drafted"] for r in tr.rounds)
            accepted = sum(r["accepted"] for r in tr.rounds)
            info = {"domain": tr.req.domain, "drafter": tr.drafter.label if tr.drafter else None,
                    "rounds": len(tr.rounds), "drafted": drafted, "accepted": accepted,
                    "shadow_rounds": sum(bool(r["full_verify"]) and r["drafted"] > 0 for r in tr.rounds)}
            self._emit(tr.req, Event(text=text, token_ids=ids, finish_reason=reason, usage=usage, info=info))
            self.metrics.requests.labels(tr.req.domain, reason).inc()
            self.metrics.e2e.labels(tr.req.domain).observe(time.perf_counter() - tr.req.arrival)
            self.policy.forget(spec.key)
            if self.trace_sink is not None:
                self._hand_trace(tr)
        if not self.batch.active and self.batch.cache.capacity > _IDLE_RESET_TOKENS:
            self.batch = self._new_batch()

    def _trace(self, tr: _Track) -> TraceRecord:
        """The finished request's trace record, validated as it is built (raises TraceFormatError)."""
        p = tr.req.params
        rounds = [RoundStat(**rd) for rd in tr.rounds] if tr.drafter is not None else []
        return TraceRecord(
            request_id=tr.req.request_id, timestamp=utc_now_iso(), domain=tr.req.domain,
            prompt_id=prompt_id_of(tr.req.prompt_text), prompt_ids=list(tr.req.prompt_ids),
            completion_ids=list(tr.spec.tokens),
            sampling={"temperature": float(p.temperature), "top_p": float(p.top_p), "top_k": int(p.top_k),
                      "max_new_tokens": int(p.max_new_tokens)},
            target_fingerprint=self.fingerprint, drafter=tr.drafter.label if tr.drafter else None,
            rounds=rounds, source="serving", finish_reason=tr.spec.finish_reason or "abort",
            calibration=tr.calibration if tr.drafter is not None else None)

    def _hand_trace(self, tr: _Track) -> None:
        """Queue the request's trace record for the writer. Called after the request was answered: an
        invalid record is logged at ERROR and counted, never written, and the engine keeps serving."""
        try:
            record = self._trace(tr)
        except (TraceFormatError, TypeError) as e:
            log.error("invalid trace record for %s, not written: %s", tr.req.request_id, e)
            self.metrics.traces_invalid.inc()
            return
        self.trace_sink(record)

    def _emit(self, req: GenRequest, ev: Event) -> None:
        try:
            req.emit(ev)
        except Exception as e:                      # the client's loop is gone: nothing to tell it
            log.debug("emit to %s failed: %s", req.request_id, e)

    def _fail_all(self, message: str) -> None:
        for tr in list(self._tracks.values()):
            self._emit(tr.req, Event(error=message))
            self.metrics.requests.labels(tr.req.domain, "error").inc()
        self._tracks.clear()
        self.batch = self._new_batch()


def _calibration_of(drafter: LoadedDrafter | None) -> tuple[Callable | None, dict | None, bool]:
    """What a newly admitted request is sized with: (raw confidence logits -> calibrated step probabilities,
    the calibration's description for its trace record, whether its rounds feed the live calibrator)."""
    if drafter is None:
        return None, None, False
    live = drafter.live
    if live is not None:                 # it measures even when disabled (then it pins the shipped calibration)
        calibrate, info = live.pin()
        return calibrate, info, True
    cal = drafter.calibration
    info = {"source": "shipped" if drafter.calibrate is not None else "none", "version": 0,
            "temperatures": [float(t) for t in cal.temperatures] if cal else [],
            "shifts": [float(b) for b in cal.shifts] if cal else []}
    return drafter.calibrate, info, False
