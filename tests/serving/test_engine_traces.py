"""The engine builds each finished request's TraceRecord itself: a valid one goes to the writer, an invalid
one (a bug in the engine) is logged at ERROR and counted apart from the writer's drops, and the request it
belongs to is answered all the same."""

import dataclasses
import logging
import threading

from dspark_core.engine.sampling import SamplingParams
from serving.engine import Event, GenRequest
from serving_helpers import FakeSource, SelfDraftProposer

PROMPT = "def add(a, b):"


def _run_one(target, tmp_path) -> tuple[list[Event], object]:
    """One greedy request straight through the engine (no HTTP); returns its events and the server."""
    from serving.server import build_server
    from serving.settings import ServeSettings
    source = FakeSource({"code": {1: lambda: SelfDraftProposer(target.runner)}}, {"code": 1})
    state = build_server(ServeSettings(home=tmp_path / "home", policy="fixed", poll_interval=0, domains=("code",),
                                       default_domain="code"), target, source)
    events, done = [], threading.Event()

    def emit(ev: Event) -> None:
        events.append(ev)
        if ev.final:
            done.set()

    state.start()
    try:
        ids = target.tokenizer(PROMPT).input_ids
        state.engine.submit(GenRequest("cmpl-1", "code", ids, PROMPT, SamplingParams(max_new_tokens=12), 0, emit))
        assert done.wait(60)
        assert state.writer.flush()
    finally:
        state.stop()
    return events, state


def _count(state, name: str) -> float:
    return state.metrics.registry.get_sample_value(name) or 0.0


def test_a_valid_record_is_written(tiny, tmp_path):
    events, state = _run_one(tiny, tmp_path)
    assert events[-1].finish_reason in ("stop", "length") and events[-1].error is None
    assert (state.writer.written, state.writer.dropped) == (1, 0)
    assert _count(state, "dspark:trace_records_invalid_total") == 0.0


def test_an_invalid_record_is_logged_and_counted_and_the_request_is_still_answered(tiny, tmp_path, caplog):
    broken = dataclasses.replace(tiny, fingerprint="")         # TraceRecord requires a target fingerprint
    with caplog.at_level(logging.ERROR, logger="dspark.serving.engine"):
        events, state = _run_one(broken, tmp_path)
    final = events[-1]
    assert final.finish_reason in ("stop", "length") and final.error is None and final.usage["completion_tokens"]
    assert _count(state, "dspark:trace_records_invalid_total") == 1.0
    assert (state.writer.written, state.writer.dropped) == (0, 0)          # not a drop: never queued
    assert _count(state, "dspark:trace_records_dropped_total") == 0.0
    assert any(r.levelno == logging.ERROR and "invalid trace record for cmpl-1" in r.getMessage()
               and "target_fingerprint" in r.getMessage() for r in caplog.records)


def test_the_engine_returns_freed_heap_pages_at_step_boundaries(tiny, tmp_path, monkeypatch):
    """glibc keeps freed pages (a swapped-out drafter's weights): the engine calls malloc_trim every
    ``memory_trim_interval`` seconds between steps; on this Linux host the call is found."""
    import serving.engine as engine_mod
    from serving.server import build_server
    from serving.settings import ServeSettings
    assert engine_mod._malloc_trim() is not None
    calls = []
    monkeypatch.setattr(engine_mod, "_TRIM", lambda pad: calls.append(pad) or 1)
    source = FakeSource({"code": {1: lambda: SelfDraftProposer(tiny.runner, delay=0.01)}}, {"code": 1})
    state = build_server(ServeSettings(home=tmp_path / "home", policy="fixed", poll_interval=0, domains=("code",),
                                       default_domain="code", traces=False, memory_trim_interval=0.05), tiny, source)
    done = threading.Event()
    state.start()
    try:
        ids = tiny.tokenizer(PROMPT).input_ids
        state.engine.submit(GenRequest("t-1", "code", ids, PROMPT, SamplingParams(max_new_tokens=40), 0,
                                       lambda ev: ev.final and done.set()))
        assert done.wait(60)
    finally:
        state.stop()
    assert calls and set(calls) == {0}
