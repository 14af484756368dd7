"""Requests and artifacts that must not hurt anyone else: values the engine cannot handle, text that is
not Unicode, oversized bodies, a full queue, bad drafter folders, and one error shape for all of it."""

import json
import threading

import httpx
import pytest

from dspark_core.data.limits import SEED_MAX, SEED_MIN, TOP_K_MAX
from dspark_core.drafters import save_drafter
from serving_helpers import FakeSource, SelfDraftProposer, peaky_dspark, plain_ids, serve

TOKEN = "abuse-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _error_shape(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "/tmp" not in body["error"]["message"] and "/work" not in body["error"]["message"], body
    return body["error"]


@pytest.fixture(scope="module")
def live(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("abuse")
    source = FakeSource({"code": {1: lambda: SelfDraftProposer(tiny.runner)},
                         "slow": {1: lambda: SelfDraftProposer(tiny.runner, delay=0.02)}},
                        {"code": 1, "slow": 1})
    server, state = serve(tiny, source, tmp, max_batch=2, domains=("code", "slow"), default_domain="code",
                          max_request_bytes=8192, max_queued=2, admin_token=TOKEN)
    with server:
        yield {"url": server.url, "state": state, "target": tiny}


@pytest.mark.parametrize("payload,param", [
    ({"seed": SEED_MAX + 1}, "seed"),
    ({"seed": SEED_MIN - 1}, "seed"),
    ({"top_k": TOP_K_MAX + 1}, "top_k"),
    ({"top_k": 10**12}, "top_k"),
    ({"max_tokens": 2**31}, "max_tokens"),
])
def test_values_the_engine_or_the_warehouse_cannot_take_are_refused(live, payload, param):
    r = httpx.post(live["url"] + "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", **payload})
    assert r.status_code == 400
    assert param in _error_shape(r)["message"]


def test_extreme_valid_seeds_are_served_and_reproducible(live):
    url = live["url"] + "/v1/completions"
    for seed in (SEED_MAX, SEED_MIN, 0):
        body = {"model": "tiny-llama", "prompt": "the cat", "max_tokens": 6, "temperature": 1.0, "seed": seed}
        a, b = httpx.post(url, json=body), httpx.post(url, json=body)
        assert a.status_code == b.status_code == 200, a.text
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


def test_a_request_that_fails_in_the_engine_fails_alone(live):
    """A value that gets past validation and breaks admission fails its own request, never the batch."""
    from serving.engine import GenRequest
    from dspark_core.engine.sampling import SamplingParams
    state, t = live["state"], live["target"]
    url = live["url"] + "/v1/completions"
    prompt = "def f(x):\n    return"
    out = {}

    def long_request():
        out["r"] = httpx.post(url, json={"model": "tiny-llama:slow", "prompt": prompt, "max_tokens": 40,
                                         "temperature": 0, "ignore_eos": True, "return_token_ids": True}, timeout=60)

    th = threading.Thread(target=long_request)
    th.start()
    events = []
    done = threading.Event()
    bad = GenRequest("bad-seed", "slow", [2, 3, 4], "x", SamplingParams(max_new_tokens=4), 2**70,
                     emit=lambda ev: (events.append(ev), ev.final and done.set()))
    state.engine.submit(bad)
    assert done.wait(30)
    assert events[-1].error and "prefill failed" in events[-1].error
    th.join(60)
    r = out["r"]
    assert r.status_code == 200, r.text
    ids = t.tokenizer(prompt).input_ids
    assert r.json()["dspark"]["completion_token_ids"] == plain_ids(t, ids, 40, ignore_eos=True)


@pytest.mark.parametrize("where", ["prompt", "model", "domain", "stop", "chat"])
def test_lone_surrogates_are_a_400(live, where):
    bad = "ab\ud800cd"
    if where == "chat":
        path, body = "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": bad}]}
    else:
        path, body = "/v1/completions", {"model": "tiny-llama", "prompt": "hi", where: bad}
        if where == "model":
            body["model"] = "tiny-llama:" + bad
        if where == "stop":
            body["stop"] = [bad]
    for stream in (False, True):                   # json.dumps escapes it: the surrogate travels as \ud800
        r = httpx.post(live["url"] + path, content=json.dumps({**body, "stream": stream}),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "surrogate" in _error_shape(r)["message"]


def test_completion_without_max_tokens_is_clipped_to_the_context(live):
    ctx = live["state"].context_length
    prompt = "a" * (ctx - 5)                       # room for 5 tokens, less than the default 16
    r = httpx.post(live["url"] + "/v1/completions", json={"model": "tiny-llama", "prompt": prompt,
                                                          "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(live["url"] + "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 16})
    assert r.status_code == 400 and _error_shape(r)["code"] == "context_length_exceeded"


def test_oversized_bodies_get_a_413_and_the_server_stays_responsive(live):
    url = live["url"] + "/v1/completions"
    big = json.dumps({"model": "tiny-llama", "prompt": "x" * 20000})
    r = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and _error_shape(r)["code"] == "request_too_large"

    def chunks():                                  # no Content-Length: caught while it streams in
        for _ in range(10):
            yield b" " * 4096
    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and _error_shape(r)["code"] == "request_too_large"
    assert httpx.get(live["url"] + "/health", timeout=1.0).status_code == 200


def test_a_full_queue_answers_429_with_retry_after(live):
    import time
    url, state = live["url"] + "/v1/completions", live["state"]
    body = {"model": "tiny-llama:code", "prompt": "count:", "max_tokens": 8, "temperature": 0}
    release = threading.Event()
    parked = threading.Thread(target=lambda: state.engine.call(lambda: release.wait(60), timeout=90))
    parked.start()                                 # the engine waits between two steps: nothing is admitted
    time.sleep(0.2)
    results, threads = [], []
    for _ in range(2):                             # max_queued = 2
        th = threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=120)))
        th.start()
        threads.append(th)
    t0 = time.time()
    while state.engine.queued() < 2 and time.time() - t0 < 30:
        time.sleep(0.01)
    r = httpx.post(url, json=body, timeout=30)
    release.set()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert _error_shape(r)["code"] == "queue_full"
    assert httpx.get(live["url"] + "/health", timeout=1.0).status_code == 200
    for th in threads + [parked]:
        th.join(120)
    assert [x.status_code for x in results] == [200, 200]                # the queued requests lost nothing


def test_framework_errors_share_the_openai_error_shape(live):
    r = httpx.get(live["url"] + "/v1/nowhere")
    assert r.status_code == 404 and _error_shape(r)["type"] == "not_found_error"
    r = httpx.get(live["url"] + "/v1/completions")
    assert r.status_code == 405 and _error_shape(r)["message"]
    r = httpx.post(live["url"] + "/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and _error_shape(r)["code"] == "invalid_json"


# ------------------------------------------------------------------------------------- drafter folders
def _corrupt(kind: str, folder):
    cfg = folder / "config.json"
    if kind == "no-config-key":
        meta = json.loads(cfg.read_text())
        del meta["config"]
        cfg.write_text(json.dumps(meta))
    elif kind == "no-fingerprint":
        meta = json.loads(cfg.read_text())
        del meta["target_fingerprint"]
        cfg.write_text(json.dumps(meta))
    elif kind == "corrupt-weights":
        (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    elif kind == "bad-json":
        cfg.write_text("{not json")


@pytest.mark.parametrize("kind", ["no-config-key", "no-fingerprint", "corrupt-weights", "bad-json"])
def test_a_bad_drafter_folder_never_crashes_the_server(tiny, tmp_path, kind):
    from serving.drafters import LocalSource
    root = tmp_path / "drafters"
    save_drafter(peaky_dspark(tiny, 3).drafter, root / "code", tiny.fingerprint)
    save_drafter(peaky_dspark(tiny, 4).drafter, root / "chat", tiny.fingerprint)
    _corrupt(kind, root / "code")
    source = LocalSource(root, tiny.runner, tiny.fingerprint)
    server, state = serve(tiny, source, tmp_path, domains=("code", "chat"), admin_token=TOKEN)
    with server:                                    # start-up: the bad domain runs without speculation
        domains = httpx.get(server.url + "/admin/drafters", headers=AUTH).json()["domains"]
        code, chat = domains["code"], domains["chat"]
        assert not code["speculation"] and "failed to load" in code["note"], code
        assert "/tmp" not in code["note"] and chat["speculation"]
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama:code", "prompt": "def f",
                                                             "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        # a reload of the bad folder: a 400 with the real reason, no server path
        r = httpx.post(server.url + "/admin/drafters/code/reload", json={}, headers=AUTH)
        err = _error_shape(r)
        assert r.status_code == 400 and err["code"] == "load_failed" and "could not be loaded" in err["message"]
        r = httpx.post(server.url + "/admin/drafters/poetry/reload", json={}, headers=AUTH)
        assert r.status_code == 404 and _error_shape(r)["code"] == "unknown_domain"


def test_the_soak_mix_is_seeded_and_its_valid_bodies_validate():
    import random
    from serving import protocol as P
    from serving.soak import INVALID_SHARE, _body
    def draw(seed):
        rng = random.Random(seed)
        return [_body(rng, [[1, 2, 3]], ["hi there"], 16) for _ in range(400)]
    a, b = draw(3), draw(3)
    assert [x["content"] for x in a] == [x["content"] for x in b]
    valid = [x for x in a if x["valid"]]
    assert abs(1 - len(valid) / len(a) - INVALID_SHARE) < 0.06
    assert {x["stream"] for x in a} == {True, False} and len({x["kind"] for x in a}) >= 8
    for x in valid:
        body = json.loads(x["content"])
        model = P.ChatCompletionRequest if x["path"].endswith("chat/completions") else P.CompletionRequest
        model.model_validate(body).check_supported()


def test_the_soak_reports_rss_around_each_admin_action():
    from serving.soak import render_markdown, rss_around
    samples = [(float(t), 1000.0 + (64.0 if t >= 202 else 0.0) + (t % 3)) for t in range(0, 400)]
    actions = [{"action": "hot-swap", "t": 200.5, "status": 200}, {"action": "rollback", "t": 300.2, "status": 200},
               {"action": "hot-swap", "t": 390.0, "status": 200}]
    got = rss_around(samples, actions)
    assert [a["step"] for a in got[:2]] == [64.0, 0.0] and got[2]["after"] is None and got[2]["step"] is None
    result = {"requests": 1, "valid_requests": 1, "errors_5xx": 0, "aborted_valid": 0,
              "latency_ms": {"p50": 1, "p99": 2}, "health_ms": {"p50": 1, "max": 2},
              "rss_mb": {"after_warmup": 1000, "peak": 1066, "end": 1065, "around_actions": got},
              "traces": {"written": 1, "ingested": 1, "quarantined": 0}, "status_counts": {"200": 1},
              "admin_actions": actions}
    text = render_markdown(result)
    assert "hot-swap 1001.0 → 1065.0 (+64.0)" in text and "(not covered)" in text
