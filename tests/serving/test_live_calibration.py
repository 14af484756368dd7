"""The live calibrator: its refit is the flow's fit, its guard refuses a worse fit, its swaps happen between
engine steps, and serving stays lossless with it on (greedy equality and the T = 1 distribution)."""

import dataclasses
import os
import threading

import httpx
import pytest
import torch

from dspark_core.calibration import Calibration, STSConfig, fit_sts, guarded_refit
from dspark_core.drafters import build_proposer
from dspark_core.engine.sampling import SamplingParams
from serving.calibrator import LiveCalibrationSettings, LiveCalibrator
from serving.engine import Event, GenRequest
from serving_helpers import FakeSource, peaky_dspark, plain_ids, serve
from tiny_models import peaky, tiny_target

TOKEN = "live-cal-token"


def _rounds(n: int, G: int, temperature: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic fully verified rounds whose true per-step acceptance is sigmoid(logit / temperature)."""
    g = torch.Generator().manual_seed(seed)
    conf = torch.randn(n, G, generator=g) * 2.5
    step_ok = torch.rand(n, G, generator=g) < torch.sigmoid(conf / temperature)
    accepted = torch.cumprod(step_ok.int(), dim=1).sum(1)
    return conf, accepted


def test_the_live_refit_is_the_offline_fit_on_the_same_rounds():
    conf, acc = _rounds(1200, 4, temperature=2.0, seed=0)
    cfg = STSConfig(shift=True, min_rounds=100)
    res = guarded_refit(conf, acc, Calibration.identity(4), cfg, holdback_every=4)
    assert res.accepted and res.reason == "better" and res.rounds_fit == 900 and res.rounds_heldback == 300
    kept = torch.arange(1200) % 4 != 0
    offline = fit_sts(conf[kept], acc[kept], cfg, previous=Calibration.identity(4))
    assert res.calibration.temperatures == offline.temperatures and res.calibration.shifts == offline.shifts
    assert sum(res.ece_candidate) < sum(res.ece_reference)        # raw logits at T = 2 are overconfident
    assert all(t > 1.2 for t in res.calibration.temperatures[:2])


def test_the_guard_refuses_a_fit_that_is_worse_on_held_back_rounds():
    # the rounds the fit sees say T = 0.5, the held-back quarter says T = 4: the fit must lose there to a
    # reference that matches the held-back rounds
    fit_c, fit_a = _rounds(900, 3, temperature=0.5, seed=1)
    held_c, held_a = _rounds(300, 3, temperature=4.0, seed=2)
    conf, acc = torch.empty(1200, 3), torch.empty(1200, dtype=torch.long)
    held = torch.arange(1200) % 4 == 0
    conf[held], acc[held], conf[~held], acc[~held] = held_c, held_a, fit_c, fit_a
    reference = Calibration([4.0, 4.0, 4.0], 0)
    res = guarded_refit(conf, acc, reference, STSConfig(shift=True, min_rounds=100))
    assert not res.accepted and res.calibration is None and res.reason == "worse_than_reference"
    assert sum(res.ece_candidate) > sum(res.ece_reference)
    few = guarded_refit(conf[:40], acc[:40], reference, STSConfig(shift=True, min_rounds=100))
    assert few.reason == "too_few_rounds" and not few.accepted


def test_the_calibrator_collects_refits_and_swaps_only_when_the_engine_applies():
    jobs = []
    shipped = Calibration([1.0, 1.0, 1.0], 10)
    live = LiveCalibrator("code", 3, shipped, LiveCalibrationSettings(window=600, refit_every=400, min_rounds=100,
                                                                      request_prior=10.0), submit=jobs.append)
    apply0, info0 = live.pin()
    assert info0 == {"source": "shipped", "version": 0, "temperatures": [1.0, 1.0, 1.0], "shifts": [],
                     "request_prior": 10.0}
    assert live.request_offset().prior == 10.0                      # each request gets its own offset
    conf, acc = _rounds(800, 3, temperature=2.5, seed=3)
    live.observe([1.0, 2.0], 1)                       # a block of another length is not this drafter's: ignored
    for c, a in zip(conf.tolist(), acc.tolist()):
        live.observe(c, a)
    assert live.describe()["window_rounds"] == 600 and len(jobs) == 1    # one fit at a time: the first is queued
    decision = jobs[0]()
    assert decision["accepted"] and live.version == 0 and live.active is shipped    # pending, not yet in use
    assert live.apply_pending() and live.version == 1 and not live.apply_pending()
    apply1, info1 = live.pin()
    assert info1["source"] == "live" and info1["version"] == 1 and info1["temperatures"] != [1.0, 1.0, 1.0]
    probe = torch.tensor([[3.0, 3.0, 3.0]])
    assert float(apply1(probe)[0, 0]) < float(apply0(probe)[0, 0])     # the refit tempers an overconfident head
    state = live.describe(with_ece=True)
    assert state["refits"] == 1 and state["last_refit"]["accepted"] and len(state["ece"]["live"]) == 3
    assert state["ece"]["live"] == state["ece"]["shipped"]        # every round so far arrived under shipped
    more_c, more_a = _rounds(300, 3, temperature=2.5, seed=4)
    for c, a in zip(more_c.tolist(), more_a.tolist()):
        live.observe(c, a)
    recent = live.window_ece(last=300)                               # rounds judged by the refit, unseen by it
    assert recent["rounds"] == 300 and sum(recent["live"]) < sum(recent["shipped"])
    jobs.clear()
    live.reset()
    assert live.version == 0 and live.active is shipped and live.describe()["window_rounds"] == 0
    live.enabled = False                               # disabled: still measures, never refits
    for c, a in zip(conf.tolist()[:500], acc.tolist()[:500]):
        live.observe(c, a)
    assert live.describe()["window_rounds"] == 500 and not jobs and live.active is shipped
    assert live.request_offset() is None and live.pin()[1]["request_prior"] == 0.0     # nor adjusts requests
    # the live ECE is prequential: each round judged by the calibration in use when it arrived
    assert live.window_ece()["live"] == live.window_ece()["shipped"]
    # a round sized with its request's offset is judged by the survival it was sized with
    live.observe([0.0, 0.0, 0.0], 3, used=[0.9, 0.8, 0.7])
    assert live.window_data(last=1)[2].tolist()[0] == pytest.approx([0.9, 0.8, 0.7])
    off = LiveCalibrator("code", 3, shipped, LiveCalibrationSettings())          # the default: no offsets
    assert off.request_offset() is None and off.pin()[1]["request_prior"] == 0.0


def test_refits_without_news_stretch_the_interval_and_news_or_a_reset_brings_it_back():
    """Steady traffic: once the calibration is right, refits find nothing better than the calibration in use
    beyond the held-back rounds' noise, so the interval doubles up to max_backoff x refit_every. A shift makes
    a refit news again (interval back to refit_every); a reset too. The fits' time adds up in fit_seconds."""
    jobs = []
    settings = LiveCalibrationSettings(window=1200, refit_every=100, min_rounds=100, max_backoff=4)
    live = LiveCalibrator("code", 3, Calibration([1.0, 1.0, 1.0], 10), settings, submit=jobs.append)

    def feed(n: int, temperature: float, seed: int) -> list[dict]:
        out = []
        conf, acc = _rounds(n, 3, temperature=temperature, seed=seed)
        for c, a in zip(conf.tolist(), acc.tolist()):
            live.observe(c, a)
            while jobs:
                out.append({**jobs.pop(0)(), "seen": live.rounds_seen})
                live.apply_pending()
        return out

    steady = feed(1200, 2.5, 10) + feed(4000, 2.5, 11)
    assert steady[0]["reason"] == "too_few_rounds" and steady[0]["next_after"] == 100   # still filling: no stretch
    assert steady[1]["accepted"] and live.version >= 1 and live.active.temperatures[0] > 1.5   # calibrated all the same
    assert [d["next_after"] for d in steady[-5:]] == [400] * 5
    assert len(steady) < 5200 // 100 // 2                   # far fewer fits than one per refit_every rounds
    assert all(len(d["ece_active_floor"]) == 3 for d in steady[1:])
    assert live.describe()["refit_interval"] == 400 and live.describe()["fit_seconds"] > 0
    drift_before = live.drift_refits
    shifted = feed(2000, 0.15, 12)                           # the head turns far underconfident: news
    # the drift watch starts the first refit within two refit_every of the shift, not after the stretched 400
    assert live.drift_refits > drift_before and shifted[0]["seen"] - 5200 <= 200
    news = [d for d in shifted if d["news"]]
    assert news and news[0]["next_after"] == 100
    assert _mean_ece(news[0]["ece_candidate"]) < _mean_ece(news[0]["ece_active"])
    live.reset()
    assert live.interval == 100
    with pytest.raises(ValueError, match="max_backoff"):
        LiveCalibrationSettings(max_backoff=0)
    with pytest.raises(ValueError, match="drift_z"):
        LiveCalibrationSettings(drift_z=0)
    with pytest.raises(ValueError, match="request_prior"):
        LiveCalibrationSettings(request_prior=-1)


def test_the_drift_score_stays_small_on_calibrated_rounds_and_grows_on_a_shift():
    """The drift watch judges the calibration in use: predictions that match the outcomes keep the z-score
    near N(0, 1); the same predictions on traffic that accepts less push it far past drift_z."""
    live = LiveCalibrator("code", 3, Calibration([2.5, 2.5, 2.5], 10),
                          LiveCalibrationSettings(window=2000, refit_every=10_000, min_rounds=100),
                          submit=lambda job: None)
    conf, acc = _rounds(1000, 3, temperature=2.5, seed=20)        # the shipped temperatures are the truth
    for c, a in zip(conf.tolist(), acc.tolist()):
        live.observe(c, a)
    assert live.drift_score() < 3.0 and live.describe()["drift_z"] == round(live.drift_score(), 3)
    conf, acc = _rounds(300, 3, temperature=2.5, seed=21)
    for c, a in zip(conf.tolist(), acc.tolist()):
        live.observe(c, max(0, a - 1))                            # every round accepts one token fewer
    assert live.drift_score() > 4.0


def _mean_ece(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_a_reader_of_rows_since_sees_every_round_once_beyond_the_window():
    live = LiveCalibrator("code", 3, Calibration([1.0, 1.0, 1.0], 10),
                          LiveCalibrationSettings(window=50, refit_every=10_000, min_rounds=100), submit=lambda job: None)
    conf, acc = _rounds(180, 3, temperature=1.0, seed=5)
    got, seen = [], 0
    for start, stop in ((0, 7), (7, 40), (40, 40), (40, 120), (120, 170)):   # reads between bursts
        for c, a in zip(conf[start:stop].tolist(), acc[start:stop].tolist()):
            live.observe(c, a)
        data, seen = live.rows_since(seen)
        if data is not None:
            got.append(data)
    assert seen == 170
    rows = torch.cat([d[0] for d in got])
    # 40 -> 120 overran the 50-round window: its first 30 rounds are gone, every other round came once
    want = torch.cat([conf[:40], conf[70:170]])
    torch.testing.assert_close(rows, want)
    assert torch.equal(torch.cat([d[1] for d in got]), torch.cat([acc[:40], acc[70:170]]))
    assert live.rows_since(seen) == (None, 170)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="thread niceness is a POSIX notion")
def test_refits_run_at_a_lower_cpu_priority_than_decoding(tmp_path):
    from serving.manager import REFIT_NICE
    from serving.server import build_server
    from serving.settings import ServeSettings
    target = dataclasses.replace(tiny_target("llama", vocab=8, seed=11), tokenizer=_LetterTokenizer())
    source = FakeSource({"code": {1: lambda: peaky_dspark(target, 5)}}, {"code": 1})
    state = build_server(ServeSettings(home=tmp_path / "home", policy="fixed", poll_interval=0, domains=("code",),
                                       default_domain="code", traces=False), target, source)

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    ours = niceness()
    refit_thread = state.manager._fit_pool.submit(niceness).result(timeout=30)   # where live refits run
    assert refit_thread == min(19, ours + REFIT_NICE) and niceness() == ours


class _LetterTokenizer:
    """Decodes the tiny vocabulary-8 target's ids as letters (the engine only decodes)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def test_sampling_through_the_engine_with_the_live_calibrator_keeps_the_target_distribution(tmp_path):
    """Joint distribution of the first 3 tokens at T = 1 through the serving engine (scheduled policy,
    confidence-driven lengths, each request's own confidence offset on) while the live calibrator refits and
    swaps every 32 labelled rounds, against the exact target distribution.

    3000 requests, each with its own seed; Pearson chi-square over the 512 joint cells (expected < 5 pooled);
    fails when p < 1e-4, i.e. a false failure has probability 1e-4.
    """
    from serving.server import build_server
    from serving.settings import ServeSettings
    from core.engine.test_lossless import PROMPT, chi_square_pvalue, exact_joint
    target = dataclasses.replace(tiny_target("llama", vocab=8, seed=11), tokenizer=_LetterTokenizer(),
                                 stop_token_ids=())
    source = FakeSource({"code": {1: lambda: peaky(build_proposer("dspark", target.runner, target.fingerprint,
                                                                  preset="tiny", block_size=2), 3)}}, {"code": 1})
    state = build_server(ServeSettings(home=tmp_path / "home", policy="scheduled", live_gate=False, poll_interval=0,
                                       domains=("code",), default_domain="code", max_batch=16, shadow_fraction=0.5,
                                       traces=False, live_refit_every=32, live_min_rounds=16, live_request_prior=10.0),
                         target, source)
    params = SamplingParams(temperature=1.0, max_new_tokens=4)      # 4: the first round drafts a whole block
    n, counts, done, lock = 3000, {}, threading.Event(), threading.Lock()
    versions: set = set()

    def emit_for(i):
        got: list[int] = []

        def emit(ev: Event) -> None:
            got.extend(ev.token_ids)
            if ev.final:
                with lock:
                    counts[tuple(got[:3])] = counts.get(tuple(got[:3]), 0) + 1
                    if sum(counts.values()) == n:
                        done.set()
        return emit

    state.start()
    try:
        for i in range(n):
            state.engine.submit(GenRequest(f"r{i}", "code", list(PROMPT), "p", params, 7000 + i, emit_for(i)))
            if i % 500 == 499:
                versions.add(state.manager.current("code").live.version)
        assert done.wait(600)
        live = state.manager.current("code").live
        versions.add(live.version)
    finally:
        state.stop()
    assert live.refits + sum(live.refusals.values()) >= 5            # it refit all along
    assert live.rounds_seen > 200 and live.refits >= 1 and len(versions) >= 2, (live.refits, live.refusals, versions)
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT, params, 3), n) > 1e-4


def test_greedy_output_admin_metrics_and_traces_with_the_live_calibrator(tiny, tmp_path):
    source = FakeSource({"chat": {1: lambda: peaky_dspark(tiny, 12)}, "code": {1: lambda: peaky_dspark(tiny, 5)}},
                        {"chat": 1, "code": 1})
    server, state = serve(tiny, source, tmp_path, policy="fixed", shadow_fraction=0.5,
                          max_batch=4, live_refit_every=16, live_min_rounds=8, live_calibration_off=("code",),
                          admin_token=TOKEN, live_request_prior=10.0)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    prompts = ["hello there, how are you?", "the cat sat on", "1 + 2 = 3, 4 + 5 =", "what is the time"]
    with server:
        c = httpx.Client(base_url=server.url, timeout=60)
        for round_ in range(3):
            for i, p in enumerate(prompts):
                r = c.post("/v1/completions", json={"model": tiny.name, "prompt": p, "max_tokens": 32,
                                                    "temperature": 0, "return_token_ids": True,
                                                    "domain": "code" if i == 3 else "chat"})
                assert r.status_code == 200
                ids = tiny.tokenizer(p).input_ids
                assert r.json()["dspark"]["completion_token_ids"] == plain_ids(tiny, ids, 32)
        cal = c.get("/admin/calibration/chat", headers=auth).json()
        live = cal["live"]
        assert cal["enabled"] and live["enabled"] and live["window_rounds"] > 16 and live["rounds_seen"] > 16
        assert live["request_prior"] == 10.0
        assert live["refits"] + sum(live["refusals"].values()) >= 1 and live["last_refit"] is not None
        assert set(live["ece"]) == {"rounds", "raw", "shipped", "live"} and len(live["ece"]["raw"]) == 4
        from flows.handoff import fetch_live_calibration          # what the drift check reads
        seen = fetch_live_calibration(server.url, "chat", TOKEN)
        assert seen.error is None and seen.rounds == live["ece"]["rounds"] and len(seen.ece_shipped) == 4
        assert fetch_live_calibration(server.url, "chat", "wrong").error.startswith("HTTP 403")
        off = c.get("/admin/calibration/code", headers=auth).json()
        assert not off["enabled"] and off["live"]["source"] == "none" and off["live"]["refits"] == 0
        assert off["live"]["window_rounds"] > 0                         # disabled, it still measures
        listing = c.get("/admin/drafters", headers=auth).json()["domains"]
        assert listing["chat"]["live_calibration"] and not listing["code"]["live_calibration"]
        assert listing["chat"]["drafter"]["live_calibration"]["window_size"] == 2048
        # turn code's on, refit chat now, reset chat
        on = c.post("/admin/calibration/code", json={"enabled": True}, headers=auth).json()
        assert on["enabled"] and on["live"]["enabled"]
        refit = c.post("/admin/calibration/chat", json={"refit": True}, headers=auth).json()
        assert refit["refit"]["reason"] in ("better", "worse_than_reference", "too_few_rounds")
        reset = c.post("/admin/calibration/chat", json={"reset": True}, headers=auth).json()
        assert reset["live"]["window_rounds"] == 0 and reset["live"]["version"] == 0
        assert c.get("/admin/calibration/nope", headers=auth).status_code == 404
        assert c.post("/admin/calibration/chat", json={"enabled": "maybe"}, headers=auth).status_code == 400
        assert c.get("/admin/calibration/chat").status_code == 401
        metrics = c.get("/metrics").text
        for name in ("dspark:live_calibration_window_rounds{", "dspark:live_calibration_version{",
                     'dspark:live_calibration_ece{calibration="live",domain="chat",position="1"}'):
            assert name in metrics
        assert "dspark:live_calibration_refits_total" in metrics or "dspark:live_calibration_refusals_total" in metrics
        assert state.writer.flush()
    from dspark_core.data.traces import read_jsonl
    records = [rec for f in sorted((tmp_path / "home" / "landing").rglob("*.jsonl")) for _, rec in read_jsonl(f)]
    assert len(records) == 12
    for rec in records:
        assert rec.calibration is not None and rec.calibration["source"] in ("none", "shipped", "live")
    assert {rec.calibration["source"] for rec in records if rec.domain == "code"} == {"none"}
    assert {rec.calibration["source"] for rec in records if rec.domain == "chat"} <= {"none", "live"}
    # chat's requests were sized with their own offsets too; code's calibrator was off: none
    assert {rec.calibration["request_prior"] for rec in records if rec.domain == "chat"} == {10.0}
    assert {rec.calibration["request_prior"] for rec in records if rec.domain == "code"} == {0.0}


def test_a_replay_sizes_each_round_with_the_calibration_fitted_before_it_and_repeats_exactly():
    """serving.calibrator.replay: recorded rounds through a fresh calibrator, refits inline. Shipped at T = 1
    on rounds whose truth is T = 3, the replay refits, its later rounds are sized by a calibration fitted on
    earlier ones only (the first rounds read the shipped one), the prequential ECE falls well below the
    shipped calibration's, and a second replay of the same rounds gives the same survival."""
    from dspark_core.calibration import position_ece, prefix_labels
    from serving.calibrator import replay
    conf, acc = _rounds(3000, 3, temperature=3.0, seed=4)
    shipped = Calibration.identity(3)
    settings = LiveCalibrationSettings(window=800, refit_every=200, min_rounds=100)
    surv, live = replay(conf, acc, shipped, settings)
    assert surv.shape == (3000, 3) and live.refits >= 2 and live.rounds_seen == 3000
    torch.testing.assert_close(surv[:200], shipped.survival(conf[:200]))        # before the first refit
    labels = prefix_labels(acc[-1500:], 3)
    assert max(position_ece(surv[-1500:], labels)) < 0.5 * max(position_ece(shipped.survival(conf[-1500:]), labels))
    again, _ = replay(conf, acc, shipped, settings)
    assert torch.equal(surv, again)


def test_the_paired_ece_difference_resolves_what_the_two_spreads_cannot():
    """Two calibrations of the same rounds: the worst-position ECE difference comes with a block-bootstrap
    range; a calibration against itself reads exactly 0, a clearly worse one a range above 0."""
    from dspark_core.calibration import paired_worst_ece_difference, prefix_labels
    conf, acc = _rounds(2000, 3, temperature=2.0, seed=6)
    labels = prefix_labels(acc, 3)
    good, bad = Calibration([2.0] * 3, 0).survival(conf), Calibration([1.0] * 3, 0).survival(conf)
    assert paired_worst_ece_difference(good, good, labels, draws=50) == {"value": 0.0, "low": 0.0, "high": 0.0}
    d = paired_worst_ece_difference(bad, good, labels, draws=50)
    assert 0 < d["low"] <= d["value"] <= d["high"]
