"""Held-out side-by-side evaluation: scheduled entries, repetitions, the round split."""

import pytest
import torch

from dspark_core.drafters import build_proposer
from dspark_core.engine.sampling import SamplingParams
from dspark_core.scheduling.policy import SPSTable
from tiny_models import peaky, tiny_target

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 33, 2], list(range(10, 30)), [7, 7, 8, 7, 7, 8, 7], [40, 41]]


def test_side_by_side_evaluation_runs_a_scheduled_entry_through_the_batched_engine():
    """The drafters bench's ``dspark-sched`` column: the scheduled entry decodes every prompt through
    run_requests with its policy and calibration, as many tokens as the plain engine, and its rounds
    verify what the policy chose (never more than the cap)."""
    from dspark_core.pipeline.evaluate import SideBySide, evaluate_side_by_side
    from dspark_core.scheduling.policy import ScheduledPolicy
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    prop = peaky(build_proposer("dspark", r, target.fingerprint, preset="tiny", block_size=4), 0)
    calls = []

    class RecordingPolicy(ScheduledPolicy):
        def __call__(self, survs, limits):
            calls.append(list(limits))
            return super().__call__(survs, limits)
    policy = RecordingPolicy({1: SPSTable((10.0, 9.9, 9.8, 9.7, 9.6))}, k=4)
    calibrated = []

    def calibrate(logits):
        calibrated.append(logits.shape[-1])
        return torch.sigmoid(logits)
    params = SamplingParams(max_new_tokens=20)
    res = evaluate_side_by_side(r, {"none": None, "dspark": prop}, PROMPTS[:3], SideBySide(params, block_size=4),
                                scheduled={"dspark-sched": (prop, policy, calibrate)})
    assert set(res) == {"none", "dspark", "dspark-sched"}
    s = res["dspark-sched"]
    assert s.prompts == 3 and s.tokens == res["none"].tokens == 60 and s.seconds > 0
    assert calls and all(0 <= m <= 4 for lim in calls for m in lim) and calibrated
    assert sum(s.verified_per_position[:1]) <= s.rounds and s.tau >= 1.0



def test_side_by_side_repetitions_keep_outputs_and_take_each_prompts_median_time(monkeypatch):
    """reps > 1: every proposer runs every prompt ``reps`` times in a rotated order; tokens and acceptance
    are the first pass's (the same seeds give the same outputs), and a proposer's time is the sum over
    prompts of each prompt's median, so one slow repetition does not move it."""
    import dspark_core.pipeline.evaluate as ev
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    prop = build_proposer("dspark", r, target.fingerprint, preset="tiny", block_size=4)
    params = SamplingParams(max_new_tokens=12)
    once = ev.evaluate_side_by_side(r, {"none": None, "dspark": prop}, PROMPTS[:2], ev.SideBySide(params, block_size=4))
    order, real = [], ev.generate
    slow = {"calls": 0}

    def timed(runner, ids, p, proposer=None, **kw):
        res = real(runner, ids, p, proposer, **kw)
        if p.max_new_tokens == params.max_new_tokens:
            order.append("none" if proposer is None else "dspark")
            slow["calls"] += 1
            # the third repetition (calls 9..12) is a slow spell: 100 s per generation
            res.stats.wall_seconds = 100.0 if slow["calls"] > 8 else (1.0 if proposer is None else 0.5)
        return res
    monkeypatch.setattr(ev, "generate", timed)
    res = ev.evaluate_side_by_side(r, {"none": None, "dspark": prop}, PROMPTS[:2],
                                   ev.SideBySide(params, block_size=4, reps=3))
    assert order[:4] == ["none", "dspark", "none", "dspark"] and order[4:8] == ["dspark", "none", "dspark", "none"]
    for name in ("none", "dspark"):
        assert res[name].tokens == once[name].tokens and res[name].rounds == once[name].rounds
        assert res[name].prompts == 2
    assert res["none"].seconds == 2.0 and res["dspark"].seconds == 1.0       # medians, not the slow spell
    assert ev.speedups(res)["dspark"] == 2.0
    with pytest.raises(ValueError):
        ev.SideBySide(params, reps=0)



def test_side_by_side_splits_each_round_into_drafting_and_the_verify_forward(monkeypatch):
    """``round_ms``: mean ms per round in the proposer's propose() and in the target's verify forward,
    over every timed pass (the drafters bench reports where a round's cost goes); plain decoding spends
    nothing drafting; a slowed drafter shows in its draft time, not in its verify time."""
    import time as _time
    import dspark_core.pipeline.evaluate as ev
    from dspark_core.bench.drafters import render_markdown
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    prop = build_proposer("dspark", r, target.fingerprint, preset="tiny", block_size=4)
    real = prop.propose

    def slow_propose(*a, **kw):
        _time.sleep(0.03)        # long beside a tiny verify forward, even on a loaded machine
        return real(*a, **kw)
    monkeypatch.setattr(prop, "propose", slow_propose)
    params = SamplingParams(max_new_tokens=12)
    res = ev.evaluate_side_by_side(r, {"none": None, "dspark": prop}, PROMPTS[:2],
                                   ev.SideBySide(params, block_size=4, reps=2))
    plain, spec = res["none"], res["dspark"]
    assert plain.timed_rounds == 2 * plain.rounds and spec.timed_rounds == 2 * spec.rounds
    assert plain.round_ms()["draft"] < 1.0 < 30.0 <= spec.round_ms()["draft"]
    assert plain.round_ms()["verify"] > 0 and spec.round_ms()["verify"] > 0
    assert spec.round_ms()["verify"] < spec.round_ms()["draft"]            # the sleep is not counted twice
    assert spec.to_dict()["round_ms"] == spec.round_ms()
    ms = {"code": {k: v.round_ms() for k, v in res.items()}}
    names = ("dspark", "dspark-lookup", "dspark-generic", "dflash", "eagle3", "ngram")
    ms["code"].update({k: ms["code"]["dspark"] for k in names})
    md = render_markdown({"tau": {"code": {k: 1.5 for k in names}}, "speedup": {"code": {k: 1.2 for k in names}},
                          "round_ms": ms})
    assert "ms per round: draft + verify (plain step" in md
    assert ev.EvalResult("x", 0.0).round_ms() is None                       # never timed


def _result(name: str, rows: list[tuple[int, int, int, float]]):
    from dspark_core.engine.stats import AcceptanceStats
    from dspark_core.pipeline.evaluate import EvalResult
    res = EvalResult(name, 0.0)
    for emitted, rounds, tokens, seconds in rows:
        res.add(AcceptanceStats(rounds=rounds, emitted=emitted, wall_seconds=seconds), tokens)
    return res


def test_paired_ratios_resample_prompts_keeping_both_drafters_figures_together():
    """tau and speed of one drafter over another on the same prompts, with a 5-95 % range over paired
    resamples: a drafter exactly twice as fast on every prompt reads 2.0 with no spread however unequal the
    prompts are; one faster on some prompts and slower on others gets a range around its value that
    narrows with more prompts; results from different prompts are refused."""
    from dspark_core.pipeline.evaluate import paired_ratios
    rows = [(10 * (i + 1), 5 * (i + 1), 20 + i, 1.0 + 3 * i) for i in range(8)]     # unequal prompts
    base = _result("none", rows)
    twice = _result("a", [(2 * e, r, t, s / 2) for e, r, t, s in rows])
    out = paired_ratios({"none": base, "a": twice}, "a", "none")
    assert out["prompts"] == 8 and out["quantiles"] == [0.05, 0.95]
    assert out["tau_ratio"] == {"value": 2.0, "low": 2.0, "high": 2.0}
    assert out["speed_ratio"] == {"value": 2.0, "low": 2.0, "high": 2.0}

    def mixed(n):
        b = _result("none", [(10, 5, 20, 1.0)] * n)
        m = _result("m", [(10, 5, 20, 0.5 if i % 2 else 1.5) for i in range(n)])
        return paired_ratios({"none": b, "m": m}, "m", "none")
    small, large = mixed(8), mixed(200)
    for r in (small, large):
        s = r["speed_ratio"]
        assert s["low"] < s["value"] < s["high"] and r["tau_ratio"]["low"] == r["tau_ratio"]["high"] == 1.0
    assert (large["speed_ratio"]["high"] - large["speed_ratio"]["low"]
            < 0.5 * (small["speed_ratio"]["high"] - small["speed_ratio"]["low"]))
    assert mixed(8) == small                                                  # seeded: the same ranges again
    with pytest.raises(ValueError, match="not measured on the same prompts"):
        paired_ratios({"none": base, "a": _result("a", rows[:3])}, "a", "none")


def test_compare_drafters_reports_each_against_drafter_with_ranges():
    """``dspark eval --against``: the evaluated drafter, n-gram lookup and a second checkpoint in one
    interleaved run; each has a speedup range around its speedup, and ``versus`` holds the evaluated one ÷
    each other with ranges; a name used twice is refused."""
    from dspark_core.drafters import build_drafter, drafter_config
    from dspark_core.drafters.checkpoint import save_drafter
    from dspark_core.pipeline.steps import EvalConfig, compare_drafters, evaluate_drafter
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = []
        for seed in (1, 2):
            model = build_drafter(drafter_config("dspark", r.arch, "tiny", block_size=4), r, seed)
            ckpts.append(save_drafter(model, Path(tmp) / f"d{seed}", target.fingerprint))
        cfg = EvalConfig(max_new_tokens=10, block_size=4)
        res = compare_drafters(target, ckpts[0], PROMPTS[:4], cfg,
                               {"ngram": ("ngram", None), "other": ("dspark", ckpts[1])})
        assert set(res.others) == set(res.versus) == {"ngram", "other"}
        for d in (res.drafter, *res.others.values()):
            lo, hi = d.speedup_range
            assert d.prompts == 4 and lo <= d.speedup <= hi
        for v in res.versus.values():
            assert v["prompts"] == 4
            assert v["tau_ratio"]["low"] <= v["tau_ratio"]["value"] <= v["tau_ratio"]["high"]
        assert res.versus["ngram"]["tau_ratio"]["value"] == pytest.approx(res.drafter.tau / res.others["ngram"].tau,
                                                                          abs=1e-3)
        out = res.to_dict()
        assert out["against"]["other"]["versus"] == res.versus["other"] and out["plain_tok_s"] > 0
        ev = evaluate_drafter(target, ckpts[0], PROMPTS[:2], cfg, baseline=ckpts[1])
        assert ev.versus["prompts"] == 2 and ev.to_dict()["versus"] == ev.versus
        with pytest.raises(ValueError, match="twice"):
            compare_drafters(target, ckpts[0], PROMPTS[:2], cfg, {"dspark": ("dspark", ckpts[1])})
