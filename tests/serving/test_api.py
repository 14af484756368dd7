"""The OpenAI-compatible API against a live uvicorn on loopback, driven by the real ``openai`` client.

Tiny seeded target (character tokenizer), tiny peaky DSpark drafters from an in-memory source. Every
greedy output is compared token for token with plain decoding (fp32), streaming and not.
"""

import json

import httpx
import openai
import pytest

from serving_helpers import FakeSource, SelfDraftProposer, peaky_dspark, plain_ids, serve

PROMPTS = ["def add(a, b):\n    return", "hello there, how are you?", "1 + 2 = 3, 4 + 5 =", "the cat sat on"]


@pytest.fixture(scope="module")
def live(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    # code: an oracle drafter (long accepted runs); chat: a peaky random DSpark drafter (mostly rejected)
    # slow: an oracle that takes 10 ms per draft, so a long request surely outlives a client's patience
    source = FakeSource({"code": {1: lambda: SelfDraftProposer(tiny.runner)},
                         "chat": {1: lambda: peaky_dspark(tiny, 12)},
                         "slow": {1: lambda: SelfDraftProposer(tiny.runner, delay=0.01)}},
                        {"code": 1, "chat": 1, "slow": 1})
    server, state = serve(tiny, source, tmp, max_batch=4, domains=("code", "chat", "slow"))
    with server:
        yield {"url": server.url, "state": state, "target": tiny,
               "client": openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)}


def test_completions_greedy_equal_plain_decoding(live):
    c, t = live["client"], live["target"]
    for prompt in PROMPTS:
        r = c.completions.create(model=t.name, prompt=prompt, max_tokens=24, temperature=0,
                                 extra_body={"return_token_ids": True})
        ids = t.tokenizer(prompt).input_ids
        want = plain_ids(t, ids, 24)
        got = r.model_extra["dspark"]["completion_token_ids"]
        assert got == want
        assert r.choices[0].text == t.tokenizer.decode(want, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
        assert r.usage.total_tokens == len(ids) + len(want)
        assert r.choices[0].finish_reason == ("stop" if want[-1] in t.stop_token_ids else "length")
        assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_streaming_completion_matches_non_streaming(live):
    c, t = live["client"], live["target"]
    prompt = PROMPTS[0]
    full = c.completions.create(model=t.name, prompt=prompt, max_tokens=30, temperature=0)
    chunks = list(c.completions.create(model=t.name, prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].text]) >= 2      # really streamed


def test_chat_streaming_and_not(live):
    c, t = live["client"], live["target"]
    msgs = [{"role": "user", "content": "write a python function"}]
    r = c.chat.completions.create(model=f"{t.name}:code", messages=msgs, max_tokens=20, temperature=0,
                                  extra_body={"return_token_ids": True})
    ids = t.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert r.model_extra["dspark"]["completion_token_ids"] == plain_ids(t, ids, 20)
    assert r.choices[0].message.role == "assistant" and r.model_extra["dspark"]["domain"] == "code"
    assert r.model_extra["dspark"]["routed_by"] == "model"
    stream = c.chat.completions.create(model=t.name, messages=msgs, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sampling_with_a_seed_is_reproducible_and_stop_strings_cut(live):
    c, t = live["client"], live["target"]
    kw = dict(model=t.name, prompt="the cat sat on", max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    full = c.completions.create(model=t.name, prompt=PROMPTS[1], max_tokens=40, temperature=0).choices[0].text
    assert len(full) > 6
    stop = full[4:6]
    cut = c.completions.create(model=t.name, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=t.name, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == full[:full.index(stop)]


def test_domain_routing_field_suffix_classifier_and_unknown(live):
    c, t = live["client"], live["target"]

    def info(**kw):
        r = c.completions.create(model=kw.pop("model", t.name), max_tokens=2, temperature=0, **kw)
        return r.model_extra["dspark"]
    assert info(prompt="hi", extra_body={"domain": "code"})["domain"] == "code"
    assert info(prompt="hi", model=f"{t.name}:code")["routed_by"] == "model"
    got = info(prompt="def f(x):\n    return x == 1")
    assert (got["domain"], got["routed_by"]) == ("code", "classifier")
    assert info(prompt="nice weather today")["domain"] == "chat"
    unknown = info(prompt="hi", extra_body={"domain": "poetry"})
    assert unknown["domain"] == "chat" and unknown["routed_by"] == "unknown:poetry"
    assert unknown["drafter"] == "fake-chat:v1"


def test_models_health_metrics(live):
    url, t = live["url"], live["target"]
    models = live["client"].models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == t.name and {f"{t.name}:code", f"{t.name}:chat", f"{t.name}:slow"} <= set(ids)
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and "running" in h and "waiting" in h
    live["client"].completions.create(model=t.name, prompt="def f(x):", max_tokens=16, temperature=0)
    m = httpx.get(url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    body = m.text
    for name in ("dspark:spec_decode_num_drafts_total{domain=\"code\"}",
                 "dspark:spec_decode_num_draft_tokens_total{domain=\"code\"}",
                 "dspark:spec_decode_num_accepted_tokens_total{domain=\"code\"}",
                 "dspark:spec_decode_num_accepted_tokens_per_pos_total{domain=\"code\",position=\"0\"}",
                 "dspark:spec_decode_verify_length_bucket", "dspark:scheduler_token_budget",
                 "dspark:num_requests_waiting", "dspark:num_requests_running",
                 "dspark:time_to_first_token_seconds_bucket", "dspark:inter_token_latency_seconds_bucket",
                 "dspark:drafter_active_version{domain=\"code\"} 1.0", "dspark:trace_records_written_total",
                 "dspark:trace_records_dropped_total", "dspark:drafter_swaps_total", "dspark:drafter_rollbacks_total"):
        assert name in body, name
    assert "_created" not in body
    assert "dspark:trace_records_invalid_total 0.0" in body          # every record the engine built was valid


@pytest.mark.parametrize("payload,status,needle", [
    ('{"model": "tiny-llama", "prompt": "hi", ', 400, "not valid JSON"),
    ({"model": "tiny-llama", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny-llama", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny-llama", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny-llama", "prompt": "hi", "n": 2}, 400, "n > 1"),
    ({"model": "tiny-llama", "prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ({"model": "tiny-llama"}, 400, "prompt"),
    ({"model": "tiny-llama", "prompt": "   "}, 400, "empty"),
    ({"model": "tiny-llama", "prompt": [1, 2, 999]}, 400, "token ids"),
    ({"model": "tiny-llama", "prompt": "x" * 600}, 400, "maximum context length is 512"),
    ({"model": "tiny-llama", "prompt": "hi", "max_tokens": 600}, 400, "maximum context length is 512"),
    ({"model": "tiny-llama", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "gpt-17", "prompt": "hi"}, 404, "does not exist"),
])
def test_bad_completion_requests_get_an_openai_error(live, payload, status, needle):
    data = payload if isinstance(payload, str) else json.dumps(payload)
    r = httpx.post(live["url"] + "/v1/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_bad_chat_requests(live):
    url = live["url"] + "/v1/chat/completions"
    for payload, needle in [({"model": "tiny-llama", "messages": []}, "messages"),
                            ({"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
                            ({"model": "tiny-llama", "messages": "hello"}, "messages")]:
        r = httpx.post(url, json=payload)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        live["client"].chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "y" * 600}])


def test_client_disconnect_frees_the_slot_and_others_are_served(live):
    url, state, c, t = live["url"], live["state"], live["client"], live["target"]
    series = 'dspark:request_success_total{domain="chat",finish_reason="abort"}'
    before = _metric(httpx.get(url + "/metrics").text, series)
    with httpx.stream("POST", url + "/v1/completions", json={"model": t.name, "prompt": "hello", "max_tokens": 400,
                                                             "temperature": 0, "stream": True, "ignore_eos": True,
                                                             "domain": "chat"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")            # streaming has begun; now hang up
    _wait(lambda: state.engine.load()["running"] == 0, "the aborted request still holds its slot")
    after = _metric(httpx.get(url + "/metrics").text, series)
    assert after == before + 1
    r = c.completions.create(model=t.name, prompt="still there?", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def _metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def _wait(cond, msg, timeout=20.0):
    import time
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, msg
        time.sleep(0.05)


def test_non_streaming_client_that_gives_up_is_cancelled(live):
    url, state, t = live["url"], live["state"], live["target"]
    series = 'dspark:request_success_total{domain="slow",finish_reason="abort"}'
    before = _metric(httpx.get(url + "/metrics").text, series)
    body = {"model": f"{t.name}:slow", "prompt": "x", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):      # >= 120 rounds x 10 ms: it cannot finish within 0.2 s
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.2))
    _wait(lambda: _metric(httpx.get(url + "/metrics").text, series) == before + 1, "the request was not cancelled")
    _wait(lambda: state.engine.load()["running"] == 0, "the cancelled request still holds its slot")
