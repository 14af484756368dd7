"""Property-based fuzzing of the live server and of the trace contract.

- schemathesis generates requests from the server's own OpenAPI schema for every route, public and admin
  (with the admin token and without it): no answer may be a 5xx, and ``/health`` must answer within a
  second after each.
- hypothesis throws arbitrary JSON at the generation routes, and mangled trace records at the record
  validator and the warehouse: a record is either valid or refused with :class:`TraceFormatError`, and
  an ingest always accounts for every line.

Bounded examples and a fixed seed (``derandomize``), so a run is the same on every machine.
"""

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_core.data.traces import TraceFormatError, TraceRecord
from serving_helpers import FakeSource, SelfDraftProposer, serve

TOKEN = "fuzz-admin-token"
FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def live(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    source = FakeSource({"code": {1: lambda: SelfDraftProposer(tiny.runner)}}, {"code": 1})
    # a short context keeps every generated request quick, whatever max_tokens it asks for
    server, state = serve(tiny, source, tmp, max_batch=4, domains=("code",), default_domain="code",
                          admin_token=TOKEN, max_model_len=48, max_request_bytes=65536)
    with server:
        yield {"url": server.url, "state": state}


def _healthy(url: str) -> None:
    t0 = time.perf_counter()
    r = httpx.get(url + "/health", timeout=1.0)
    assert r.status_code == 200 and time.perf_counter() - t0 < 1.0


def _fuzz_every_route(url: str, headers: dict | None, check) -> list[str]:
    """Requests generated from the server's OpenAPI schema, ``FUZZ`` examples per operation, each answer
    handed to ``check``; returns the operations fuzzed."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    seen = []
    for result in schema.get_all_operations():
        op = result.ok()
        seen.append(f"{op.method.upper()} {op.path}")

        @FUZZ
        @given(case=op.as_strategy())
        def run(case):
            response = case.call(base_url=url, headers=headers, timeout=30)
            check(case, response)
            _healthy(url)

        run()
    return seen


def test_no_route_answers_5xx_with_the_admin_token(live):
    def check(case, response):
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    seen = _fuzz_every_route(live["url"], {"Authorization": f"Bearer {TOKEN}"}, check)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /admin/drafters/{domain}/reload"} <= set(seen)


def test_no_route_answers_5xx_without_the_admin_token(live):
    def check(case, response):
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
        if case.path.startswith("/admin"):
            assert response.status_code in (401, 403)     # no token, or one schemathesis made up
    _fuzz_every_route(live["url"], None, check)


JSON = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
                    | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny-llama", "tiny-llama:code", "dspark", "nope"]) | st.text(max_size=10),
    "prompt": st.text(max_size=60) | st.lists(st.integers(min_value=-5, max_value=100), max_size=8) | JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                                                "content": st.text(max_size=40) | JSON}), max_size=3) | JSON,
    "max_tokens": st.integers(min_value=-3, max_value=2**40) | JSON,
    "temperature": st.floats(min_value=-1, max_value=3, allow_nan=False) | JSON,
    "top_p": st.floats(min_value=-0.5, max_value=1.5, allow_nan=False),
    "top_k": st.integers(min_value=-3, max_value=2**40),
    "seed": st.integers(min_value=-2**70, max_value=2**70),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "domain": st.text(max_size=8) | JSON,
})


@given(body=FIELDS, chat=st.booleans())
@FUZZ
def test_arbitrary_generation_bodies_never_get_a_5xx(live, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(live["url"] + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code < 500, (body, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    _healthy(live["url"])


# --------------------------------------------------------------------------------------- trace records
VALID = {"request_id": "r-1", "timestamp": "2025-01-01T12:00:00.000Z", "domain": "code",
         "prompt_id": "0123456789abcdef", "prompt_ids": [1, 2, 3], "completion_ids": [4, 5],
         "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_new_tokens": 16},
         "target_fingerprint": "fp", "drafter": None, "rounds": [], "source": "serving", "finish_reason": "stop",
         "schema_version": 1}
MANGLED = st.dictionaries(st.sampled_from(sorted(VALID)), JSON | st.floats() | st.integers(), max_size=3).map(
    lambda changes: {**VALID, **changes})


@given(record=MANGLED)
@settings(max_examples=200, deadline=None, derandomize=True)
def test_a_mangled_record_is_valid_or_refused_with_a_reason(record):
    try:
        rec = TraceRecord.from_dict(json.loads(json.dumps(record)), "fuzz")
    except TraceFormatError as e:
        assert str(e).startswith("fuzz")
        return
    assert TraceRecord.from_dict(rec.to_dict(), "again") == rec


@given(records=st.lists(MANGLED, min_size=1, max_size=8))
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_ingest_accounts_for_every_mangled_line(tmp_path_factory, records):
    from registry.warehouse import TraceWarehouse
    tmp = tmp_path_factory.mktemp("ingest")
    f = tmp / "code" / "x.jsonl"
    f.parent.mkdir(parents=True)
    f.write_text("".join(json.dumps({**r, "request_id": f"r-{i}"}) + "\n" for i, r in enumerate(records)))
    with TraceWarehouse(tmp / "w.duckdb", vocab_sizes={"fp": 64}) as wh:
        res = wh.ingest_file(f)
        assert res.read == len(records) == res.stored + res.quarantined + res.duplicates
        t = wh.totals()
        assert t.stored == t.trace_rows and t.quarantined == t.quarantine_rows
