"""Hot-swap from the MLflow registry under load, the trace loop, and the admin API's auth.

Hermetic: a sqlite MLflow store in a temporary folder with two versions of a tiny DSpark drafter for
domain "code" (registered once per module: each log_model costs about a second), the tiny seeded target,
a live uvicorn on loopback and the real ``openai`` client.
"""

import threading
import time

import httpx
import openai
import pytest

from dspark_core.drafters import save_drafter
from serving_helpers import FakeSource, peaky_dspark, plain_ids, serve

TOKEN = "s3cret-admin-token"
SPS = {"sps": [400.0, 390.0, 380.0, 370.0, 350.0, 330.0, 310.0, 290.0, 270.0, 250.0, 230.0, 210.0], "rows": 1}


@pytest.fixture(scope="module")
def registry(tiny, tmp_path_factory):
    from registry.mlflow_registry import DrafterRegistry
    tmp = tmp_path_factory.mktemp("reg")
    reg = DrafterRegistry(f"sqlite:///{tmp}/mlflow.db", artifact_location=str(tmp / "mlartifacts"))
    cal = {"temperatures": [1.0, 1.2, 1.5, 2.0], "rounds": 300, "drafter": "dspark",
           "target_fingerprint": tiny.fingerprint}
    for seed in (21, 22):
        ck = save_drafter(peaky_dspark(tiny, seed).drafter, tmp / f"ck{seed}", tiny.fingerprint)
        reg.register("code", ck, params={"seed": seed}, metrics={"tau": 1.5}, calibration=cal, sps=SPS)
    reg.promote("code", 1, "first champion")
    return reg


def _source(tiny, registry, tmp):
    from serving.drafters import RegistrySource
    return RegistrySource(registry, tmp / "cache", tiny.runner, tiny.fingerprint, window=64)


def test_hot_swap_during_16_streams_loses_nothing_and_stays_lossless(tiny, registry, tmp_path):
    source = _source(tiny, registry, tmp_path)
    registry.download("code", 2, tmp_path / "cache" / "code" / "v2")       # warm, so the swap itself is quick
    server, state = serve(tiny, source, tmp_path, policy="scheduled", admin_token=TOKEN, shadow_fraction=0.25,
                          max_batch=16)
    prompts = [f"def f{i}(x):\n    return x * {i} + " for i in range(16)]
    results, errors, started, done = {}, [], threading.Barrier(17), [False] * 16

    def stream(i, client):
        try:
            chunks = client.completions.create(model=tiny.name, prompt=prompts[i], max_tokens=160, temperature=0,
                                               stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
            first = True
            for ch in chunks:
                if first:
                    first = False
                    started.wait(60)
                if ch.choices and ch.choices[0].finish_reason:
                    results[i] = ch.model_extra["dspark"]
            done[i] = True
        except Exception as e:            # noqa: BLE001 - every failure is a test failure below
            errors.append(repr(e))
            started.abort()

    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        threads = [threading.Thread(target=stream, args=(i, client)) for i in range(16)]
        for t in threads:
            t.start()
        started.wait(60)                  # all 16 are streaming
        registry.promote("code", 2, "test swap")
        r = httpx.post(server.url + "/admin/drafters/code/reload", json={"alias": "champion"},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        in_flight_at_swap = 16 - sum(done)
        assert r.status_code == 200, r.text
        assert r.json()["swapped"] and r.json()["version"] == 2 and r.json()["previous_version"] == 1
        after = client.completions.create(model=f"{tiny.name}:code", prompt="def g(y):", max_tokens=40,
                                          temperature=0, extra_body={"return_token_ids": True})
        for t in threads:
            t.join(120)
        drafters = httpx.get(server.url + "/admin/drafters", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        state.writer.flush()
        landing = state.settings.landing_dir
    assert state.metrics.registry.get_sample_value("dspark:trace_records_invalid_total") == 0.0

    assert errors == [] and len(results) == 16
    assert in_flight_at_swap > 0, "the swap must happen while streams are running"
    for i, info in results.items():
        assert info["completion_token_ids"] == plain_ids(tiny, tiny.tokenizer(prompts[i]).input_ids, 160, True), i
        assert info["drafter"] == "dspark-code:v1"          # in-flight requests finish on their drafter
    assert after.model_extra["dspark"]["drafter"] == "dspark-code:v2"
    want = plain_ids(tiny, tiny.tokenizer("def g(y):").input_ids, 40)
    assert after.model_extra["dspark"]["completion_token_ids"] == want
    code = drafters["domains"]["code"]
    assert code["drafter"]["version"] == 2 and code["previous"] == "dspark-code:v1" and code["following"] == "champion"
    chat = drafters["domains"]["chat"]
    assert chat["speculation"] is False and "no registered drafter" in chat["note"]
    assert drafters["policy"].startswith("scheduled, SPS(B) from registry sps.json")

    # the trace loop: every finished request landed once and the warehouse ingests it
    from registry.warehouse import TraceWarehouse
    files = sorted(landing.glob("code/serving-*.jsonl"))
    assert files
    with TraceWarehouse(tmp_path / "traces.duckdb") as wh:
        summary = wh.ingest_landing(landing)
        assert summary.stored == 17 and summary.quarantined == 0
        recs = wh.records(domain="code")
    assert {r.drafter for r in recs} == {"dspark-code:v1", "dspark-code:v2"}
    assert all(r.source == "serving" and r.rounds for r in recs)
    assert any(rd.full_verify and rd.drafted > 0 for r in recs for rd in r.rounds)        # shadow rounds
    assert all(rd.accepted <= rd.verified <= rd.drafted for r in recs for rd in r.rounds)


def test_registry_poller_follows_the_champion_alias(tiny, registry, tmp_path):
    registry.promote("code", 1, "reset for the poller test")
    server, state = serve(tiny, _source(tiny, registry, tmp_path), tmp_path, admin_token=TOKEN, poll_interval=0.2)
    with server:
        assert state.manager.current("code").version == 1
        registry.promote("code", 2, "poller picks this up")
        t0 = time.time()
        while state.manager.current("code").version != 2:
            assert time.time() - t0 < 30, "the poller did not follow the alias"
            time.sleep(0.1)
        audit = httpx.get(server.url + "/admin/audit", headers={"Authorization": f"Bearer {TOKEN}"}).json()["entries"]
    assert any(e["action"] == "reload" and e["actor"] == "poller" and e["version"] == 2 for e in audit)
    lines = state.settings.audit_path.read_text().splitlines()
    assert any('"actor": "poller"' in line for line in lines)


def test_canary_rolls_back_a_bad_drafter_by_itself(tiny, tmp_path):
    from serving_helpers import SelfDraftProposer
    source = FakeSource({"code": {1: lambda: SelfDraftProposer(tiny.runner),       # an oracle: ~all accepted
                                  2: lambda: peaky_dspark(tiny, 99),               # random init: ~none accepted
                                  3: lambda: SelfDraftProposer(tiny.runner)}}, {"code": 1})
    server, state = serve(tiny, source, tmp_path, admin_token=TOKEN, canary_rounds=16, canary_ratio=0.7,
                          domains=("code",), default_domain="code")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    prompts = [f"x = {i} + {i}; y = x *" for i in range(12)]
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)

        def run(p):
            r = client.completions.create(model=tiny.name, prompt=p, max_tokens=48, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
            want = plain_ids(tiny, tiny.tokenizer(p).input_ids, 48, True)
            assert r.model_extra["dspark"]["completion_token_ids"] == want
            return r.model_extra["dspark"]["drafter"]
        assert {run(p) for p in prompts[:3]} == {"fake-code:v1"}                   # baseline window fills
        r = httpx.post(server.url + "/admin/drafters/code/reload", json={"version": 2}, headers=auth)
        assert r.status_code == 200 and r.json()["canary"]["status"] == "running", r.text
        used = [run(p) for p in prompts[3:9]]
        assert used[0] == "fake-code:v2" and used[-1] == "fake-code:v1"            # rolled back mid-way
        d = httpx.get(server.url + "/admin/drafters", headers=auth).json()["domains"]["code"]
        assert d["drafter"]["label"] == "fake-code:v1" and d["rejected_versions"] == [2]
        assert d["canary"]["status"] == "rolled_back" and d["canary"]["observed"] < 0.7 * d["canary"]["baseline"]
        metrics = httpx.get(server.url + "/metrics").text
        assert 'dspark:drafter_rollbacks_total{domain="code",reason="canary"} 1.0' in metrics
        assert 'dspark:drafter_swaps_total{domain="code",reason="canary_rollback"} 1.0' in metrics
        audit = httpx.get(server.url + "/admin/audit", headers=auth).json()["entries"]
        assert [e["action"] for e in audit if e["action"].startswith("canary")] == ["canary_rollback"]
        # the poller leaves a rejected version alone, and follows the alias to a new one
        source.champion["code"] = 2
        assert httpx.post(server.url + "/admin/poll", headers=auth).json()["reloaded"] == []
        source.champion["code"] = 3
        assert [x["version"] for x in httpx.post(server.url + "/admin/poll", headers=auth).json()["reloaded"]] == [3]
        assert run(prompts[9]) == "fake-code:v3"
        # a manual rollback returns to the drafter used before (v1) and rejects v3
        r = httpx.post(server.url + "/admin/drafters/code/rollback", json={"reason": "test"}, headers=auth)
        assert r.status_code == 200 and r.json()["drafter"] == "fake-code:v1" and 3 in r.json()["rejected_versions"]
        assert run(prompts[10]) == "fake-code:v1"


def test_admin_auth_and_bad_admin_requests(tiny, tmp_path):
    source = FakeSource({"code": {1: lambda: peaky_dspark(tiny, 5)}}, {"code": 1})
    off, _ = serve(tiny, source, tmp_path / "off", admin_token=None)
    with off:
        r = httpx.get(off.url + "/admin/drafters", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 404 and "disabled" in r.json()["error"]["message"]
    on, _ = serve(tiny, source, tmp_path / "on", admin_token=TOKEN)
    with on:
        url = on.url + "/admin/drafters"
        r = httpx.get(url)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert httpx.post(on.url + "/admin/drafters/code/reload", json={"alias": "champion"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 403
        r = httpx.post(on.url + "/admin/drafters/code/rollback", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 403
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(url, headers=auth).status_code == 200
        cases = [("/admin/drafters/poetry/reload", {"alias": "champion"}, 404),
                 ("/admin/drafters/code/reload", {"alias": "champion", "version": 1}, 400),
                 ("/admin/drafters/code/reload", {"version": 7}, 404),
                 ("/admin/drafters/code/reload", {"bogus": 1}, 400),
                 ("/admin/drafters/code/rollback", {}, 409)]             # nothing loaded before v1
        for path, body, status in cases:
            r = httpx.post(on.url + path, json=body, headers=auth)
            assert r.status_code == status, (path, body, r.text)
            assert r.json()["error"]["message"]
        r = httpx.post(on.url + "/admin/drafters/code/reload", json={"alias": "champion"}, headers=auth)
        assert r.status_code == 200 and r.json()["swapped"] is False       # already the champion


def test_a_registry_rollback_with_no_previous_champion_is_a_409(tiny, tmp_path):
    from registry.mlflow_registry import DrafterRegistry
    reg = DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db", artifact_location=str(tmp_path / "mlartifacts"))
    ck = save_drafter(peaky_dspark(tiny, 31).drafter, tmp_path / "ck31", tiny.fingerprint)
    reg.register("code", ck, params={}, metrics={"tau": 1.5})
    reg.promote("code", 1, "the only champion")
    server, _ = serve(tiny, _source(tiny, reg, tmp_path), tmp_path, admin_token=TOKEN)
    with server:
        r = httpx.post(server.url + "/admin/drafters/code/rollback", json={"registry": True},
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
        assert "no previous champion" in r.json()["error"]["message"]


def test_swapped_out_drafters_are_freed_but_the_one_kept_for_rollback(tiny, tmp_path):
    """A server keeps two drafters per domain: the current one and the previous one (an instant rollback).
    Every other drafter a swap replaces is freed once its requests finish, through swaps, a canary and a
    manual rollback, with the live calibrator and traces on."""
    import gc
    import weakref
    source = FakeSource({"code": {v: (lambda: peaky_dspark(tiny, 7)) for v in range(1, 9)}}, {"code": 1})
    server, state = serve(tiny, source, tmp_path, admin_token=TOKEN, domains=("code",), default_domain="code",
                          live_refit_every=8, live_min_rounds=8, traces=True)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    refs = []
    with server:
        c = httpx.Client(base_url=server.url, timeout=60)

        def traffic():
            for p in ("def f(x):", "x = 1 + 2", "for i in range("):
                r = c.post("/v1/completions", json={"model": tiny.name, "prompt": p, "max_tokens": 16,
                                                    "temperature": 0.7, "seed": 1})
                assert r.status_code == 200, r.text
        traffic()
        refs.append(weakref.ref(state.manager.current("code")))
        for v in range(2, 8):
            assert c.post("/admin/drafters/code/reload", json={"version": v}, headers=auth).status_code == 200
            refs.append(weakref.ref(state.manager.current("code")))
            traffic()
            if v == 4:
                assert c.post("/admin/drafters/code/rollback", json={}, headers=auth).status_code == 200
                traffic()
        gc.collect()
        alive = [i for i, r in enumerate(refs) if r() is not None]
        held = {state.manager.current("code").label, state.manager.slots["code"].previous.label}
        assert len(alive) == 2 and {refs[i]().label for i in alive} == held, alive
