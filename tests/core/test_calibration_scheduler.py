"""Calibration metrics, STS, SPS tables and the verify-length policies."""


import pytest
import torch

from dspark_core.calibration import (Calibration, auroc, brier, crossfit_metrics, ece, ece_floor, fit_sts, prefix_labels,
                                     survival)
from dspark_core.sampling import rejection_sample
from dspark_core.scheduler import (SPSTable, causal_greedy, fixed_lengths, global_search_capacity,
                                   threshold_lengths, top_k_lengths)


def test_ece_matches_a_hand_worked_example():
    # 4 bins of width 0.25. Bin 0: preds .1,.2 labels 0,1 -> |.15 - .5| = .35, weight 2/6.
    # Bin 2: preds .6 label 1 -> |.6 - 1| = .4, weight 1/6. Bin 3: .8,.9,.95 labels 1,1,0 -> |.8833 - .6667|.
    pred = torch.tensor([0.1, 0.2, 0.6, 0.8, 0.9, 0.95])
    label = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    expect = (2 * 0.35 + 1 * 0.4 + 3 * abs((0.8 + 0.9 + 0.95) / 3 - 2 / 3)) / 6
    assert ece(pred, label, bins=4) == pytest.approx(expect, abs=1e-6)
    assert ece(pred, label, bins=4, min_count=2) == pytest.approx((2 * 0.35 + 3 * abs(2.65 / 3 - 2 / 3)) / 5,
                                                                 abs=1e-6)


def test_ece_floor_is_the_sampling_noise_of_a_calibrated_predictor():
    """Binned ECE is biased upward by sampling noise: the floor matches the analytic expectation
    sqrt(2/pi) sum_b sqrt(n_b p_b (1 - p_b)) / N, halves when N quadruples, and a head that is off by
    0.1 sits far above it while a calibrated one sits near it."""
    import math
    gen = torch.Generator().manual_seed(3)
    for n in (500, 2000):
        pred = 0.2 + 0.6 * torch.rand(n, generator=gen)
        idx = (pred * 15).long()
        expect = sum(math.sqrt(2 / math.pi) * math.sqrt(int((idx == b).sum()) * p * (1 - p))
                     for b in range(15) if int((idx == b).sum())
                     for p in [float(pred[idx == b].mean())]) / n
        assert ece_floor(pred) == pytest.approx(expect, rel=0.15)
    pred = 0.2 + 0.6 * torch.rand(8000, generator=gen)
    assert 0.4 < ece_floor(pred) / ece_floor(pred[:2000]) < 0.6
    calibrated = (torch.rand(8000, generator=gen) < pred).float()
    shifted = (torch.rand(8000, generator=gen) < pred - 0.1).float()
    floor = ece_floor(pred)
    assert ece(pred, calibrated) < 2 * floor
    assert ece(pred, shifted) > 5 * floor
    assert ece_floor(torch.empty(0)) == 0.0


def test_auroc_and_brier():
    assert auroc(torch.tensor([0.9, 0.8, 0.3, 0.1]), torch.tensor([1, 1, 0, 0])) == 1.0
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == 0.5
    assert brier(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])) == 0.5


def test_prefix_labels_and_survival():
    assert prefix_labels(torch.tensor([0, 2]), 3).tolist() == [[0, 0, 0], [1, 1, 0]]
    s = survival(torch.zeros(1, 3))
    assert torch.allclose(s, torch.tensor([[0.5, 0.25, 0.125]]))


def _synthetic(n, true_t, G=3, seed=0, true_b=None):
    """Rounds whose true per-step acceptance is sigmoid(g / true_t[k] + true_b[k]); the head reports g."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, G, generator=gen) * 2.0 + 1.0
    p = torch.sigmoid(g / torch.tensor(true_t) + torch.tensor(true_b or [0.0] * G))
    ok = torch.rand(n, G, generator=gen) < p
    accepted = torch.cumprod(ok.int(), dim=-1).sum(-1)
    return g, accepted


def test_sts_recovers_known_temperatures():
    """20k synthetic rounds; the fitted T_k lands within 0.25 of the truth and ECE drops (deterministic)."""
    true_t = [2.0, 0.7, 1.5]
    g, acc = _synthetic(20000, true_t)
    cal = fit_sts(g, acc)
    for got, want in zip(cal.temperatures, true_t):
        assert abs(got - want) <= 0.25, (cal.temperatures, true_t)
    for raw, fitted in zip(cal.raw, cal.calibrated):
        assert fitted["ece"] <= raw["ece"] + 1e-9
    assert max(c["ece"] for c in cal.calibrated) < 0.02


def test_shift_fixes_an_overconfident_head_that_temperature_cannot():
    """20k synthetic rounds from a head that is confidently wrong on average (true acceptance
    sigmoid(g - 2.5)): no temperature on the grid brings position 1 under 5 % ECE, the fitted shift
    lands within 0.3 of the truth and brings every position under 2 % (deterministic)."""
    g, acc = _synthetic(20000, [1.0, 1.0, 1.0], true_b=[-2.5, -1.0, 0.0])
    temp_only = fit_sts(g, acc)
    assert temp_only.calibrated[0]["ece"] > 0.05
    cal = fit_sts(g, acc, shift=True)
    assert abs(cal.shifts[0] + 2.5) <= 0.3 and abs(cal.temperatures[0] - 1.0) <= 0.25, (cal.temperatures, cal.shifts)
    assert max(c["ece"] for c in cal.calibrated) < 0.02
    again = Calibration.from_dict(cal.to_dict())
    torch.testing.assert_close(again.survival(g[:5]), survival(g[:5], torch.tensor(cal.temperatures),
                                                              torch.tensor(cal.shifts)))


def test_crossfit_reads_what_a_calibration_does_for_rounds_it_was_not_fitted_on():
    """Two groups of 10k synthetic rounds. From one distribution, the out-of-fold ECE is as low as the
    in-sample one. From two (true temperatures 2.5 and 0.5: prompts whose heads differ), the pooled fit is
    nearly calibrated in-sample, but each group calibrated by the other group's fit is far off, and only
    the cross-fit shows it (deterministic)."""
    same = [_synthetic(10000, [2.0, 1.0, 1.5], seed=s) for s in (1, 2)]
    pooled = fit_sts(torch.cat([g for g, _ in same]), torch.cat([a for _, a in same]))
    cross = crossfit_metrics(same)
    assert [m["count"] for m in cross] == [20000] * 3
    for m, c in zip(cross, pooled.calibrated):
        assert m["ece"] < 0.02 and abs(m["ece"] - c["ece"]) < 0.01
    apart = [_synthetic(10000, [2.5, 2.5, 2.5], seed=3), _synthetic(10000, [0.5, 0.5, 0.5], seed=4)]
    pooled = fit_sts(torch.cat([g for g, _ in apart]), torch.cat([a for _, a in apart]))
    cross = crossfit_metrics(apart)
    assert max(m["ece"] for m in pooled.calibrated) < 0.05          # about 0.03 / 0.02 / 0.02
    for m, c in zip(cross, pooled.calibrated):                      # about 0.18 / 0.18 / 0.15
        assert m["ece"] > 0.1 and m["ece"] > 3 * c["ece"]
    with pytest.raises(ValueError, match="at least two groups"):
        crossfit_metrics(same[:1])


def test_sts_small_sample_falls_back_with_a_warning():
    g, acc = _synthetic(50, [2.0, 2.0, 2.0])
    prev = Calibration([1.3, 1.1, 0.9], 1000)
    with pytest.warns(RuntimeWarning, match="refit skipped"):
        cal = fit_sts(g, acc, previous=prev)
    assert cal.fallback and cal.temperatures == [1.3, 1.1, 0.9]
    with pytest.raises(ValueError, match=r"\[N, G\]"):
        fit_sts(g[:, 0], acc)


def test_calibration_round_trips_and_applies():
    cal = Calibration([2.0, 0.5], 10)
    again = Calibration.from_dict(cal.to_dict())
    out = again.apply(torch.tensor([[2.0, 1.0]]))
    assert torch.allclose(out, torch.sigmoid(torch.tensor([[1.0, 2.0]])))


def test_sps_table_is_monotone_and_extrapolates():
    t = SPSTable.monotone([10.0, 11.0, 8.0, 9.0])
    assert t.sps == (10.0, 10.0, 8.0, 8.0)
    assert t(6) < t(4)
    with pytest.raises(ValueError):
        SPSTable(())


def test_causal_greedy_follows_algorithm_1():
    sps = SPSTable((1.0, 0.9, 0.85, 0.8, 0.5))
    surv = torch.tensor([[0.9, 0.8, 0.1], [0.95, 0.2, 0.1]])
    # B=2: Theta = 2; add (1,1) .95 -> 2.95*.85; add (0,1) .9 -> 3.85*.8 = 3.08; add (0,2) .8 -> 4.65*.5 stop
    assert causal_greedy(surv, sps) == [1, 1]
    assert causal_greedy(torch.zeros(2, 3), sps) == [0, 0]


def test_counter_example_naive_global_search_is_biased_early_stop_is_exact():
    """Paper Appendix A: target (A .7, B .3), draft (.5, .5), a_1 = 0.8, c_2 = 0.9 after A and 0 after B,
    SPS(1..3) = 1, .5, .45. The naive global argmax verifies x_1 only when it is A, so P(A) = 0.85; the
    early-stop rule never verifies here and P(A) stays 0.7.

    40,000 rounds each; the standard deviation of the estimate is <= 0.0025, the bound 0.02 is 8 sd
    away (false failure < 1e-14), and 0.85 vs 0.7 is 60 sd apart.
    """
    sps = SPSTable((1.0, 0.5, 0.45))
    target = torch.tensor([[0.7, 0.3], [0.7, 0.3], [0.7, 0.3]])
    draft = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    gen = torch.Generator().manual_seed(0)

    def naive(a1, a2):
        best_len, best = 0, 1 * sps(1)
        tau = 1.0
        for j, a in enumerate((a1, a2), 1):
            tau += a
            if tau * sps(1 + j) > best:
                best, best_len = tau * sps(1 + j), j
        return best_len

    def run(policy, n=40000):
        a_count = 0
        for _ in range(n):
            x1 = int(torch.multinomial(draft[0], 1, generator=gen))
            c2 = 0.9 if x1 == 0 else 0.0
            surv = torch.tensor([[0.8, 0.8 * c2]])
            ell = policy(surv)
            if ell == 0:
                tok = int(torch.multinomial(target[0], 1, generator=gen))
            else:
                x2 = int(torch.multinomial(draft[1], 1, generator=gen))
                toks = torch.tensor([x1, x2])[:ell]
                n_acc, nxt = rejection_sample(toks, draft[:ell], target[:ell + 1], gen)
                tok = x1 if n_acc >= 1 else nxt
            a_count += tok == 0
        return a_count / n

    p_naive = run(lambda s: naive(float(s[0, 0]), float(s[0, 1])))
    p_causal = run(lambda s: causal_greedy(s, sps)[0])
    assert abs(p_naive - 0.85) < 0.02
    assert abs(p_causal - 0.7) < 0.02


def test_other_policies():
    assert fixed_lengths(3, 5, 7) == [5, 5, 5]
    assert threshold_lengths(torch.tensor([[0.9, 0.4, 0.9], [0.2, 0.9, 0.9]]), 0.5) == [1, 0]
    surv = torch.tensor([[0.9, 0.5], [0.8, 0.7]])
    assert top_k_lengths(surv, 3) == [1, 2]
    assert global_search_capacity(surv, SPSTable((1.0, 1.0, 1.0, 1.0, 1.0, 1.0))) == 4


def test_sts_keeps_t_1_where_a_position_has_no_evidence():
    g, acc = _synthetic(2000, [1.0, 1.0, 1.0])
    acc = acc.clamp(max=1)                       # nobody ever gets past position 1
    cal = fit_sts(g, acc)
    assert cal.temperatures[1:] == [1.0, 1.0]


def test_a_table_profiled_at_more_rows_keeps_its_drafting_jump_at_r_plus_1():
    from dspark_core.scheduler import ScheduledPolicy
    sps16 = SPSTable(tuple([30.0] * 16 + [20.0, 19.0, 18.0]))      # 16 rows: flat, then the drafting pass
    policy = ScheduledPolicy({16: sps16}, k=2)
    assert policy.table(16) is sps16
    at15 = policy.table(15)
    assert at15(15) == 30.0 and at15(16) == 20.0 and at15(17) == 19.0   # no free one-row draft at 15 rows
    # one confident row among 15 hopeless ones: its draft does not pay for a whole drafting pass
    surv = torch.zeros(15, 2)
    surv[3] = torch.tensor([0.9, 0.8])
    assert policy.plan(list(range(15)), list(surv)) == [False] * 15
    assert ScheduledPolicy({15: sps16}, k=2).plan(list(range(15)), list(surv))[3]   # read as is: "free"


def test_forced_drafts_gather_into_few_steps():
    """Rows join one per step and never look worth drafting; each still drafts now and then for a fresh
    estimate, but the drafting passes (a fixed cost per step) are shared instead of one per join."""
    from dspark_core.scheduler import ScheduledPolicy
    policy = ScheduledPolicy({8: SPSTable(tuple([30.0] * 8 + [10.0] * 40))}, k=2, explore_every=8)
    low = torch.tensor([0.05, 0.01])
    survs: dict[int, torch.Tensor | None] = {}
    last_draft: dict[int, int] = {}
    drafting_steps = 0
    for step in range(64):
        if step < 8:
            survs[step] = None                            # a new row, no history yet
        keys = sorted(survs)
        plan = policy.plan(keys, [survs[k] for k in keys])
        drafting_steps += any(plan)
        for k, go in zip(keys, plan):
            if go:
                survs[k], last_draft[k] = low, step
            assert step - last_draft.get(k, step - 4) <= 8    # nobody waits longer than explore_every
    # one pass for the first row, then every explore_every steps for all (it was one per join, then
    # one per step as the joins' due dates came round)
    assert drafting_steps <= 1 + 64 // 8


def test_load_bench_measures_chosen_levels_and_policies_and_always_its_baseline():
    """``--concurrency 16,8`` measures 8 and 16 (ascending); ``--policies scheduled`` runs scheduled beside the
    no-speculation baseline, which every ratio needs; the table shows only the policies that ran."""
    import argparse

    from dspark_core.bench_load import (CONCURRENCY, POLICIES, RUN_ORDER, bench_concurrency, bench_policies,
                                        render_markdown)
    a = argparse.Namespace(concurrency="16,8", policies="scheduled")
    assert bench_concurrency(a, CONCURRENCY) == (8, 16) and bench_policies(a) == ("none", "scheduled")
    empty = argparse.Namespace()
    assert bench_concurrency(empty, CONCURRENCY) == CONCURRENCY and bench_policies(empty) == POLICIES
    assert bench_policies(argparse.Namespace(policies="none")) == ("none",)
    # the pair the >= 1.0 goal compares runs back to back, whichever way a repetition runs
    assert sorted(RUN_ORDER) == sorted(POLICIES)
    assert abs(RUN_ORDER.index("none") - RUN_ORDER.index("scheduled")) == 1
    result = {"concurrency": [8], "throughput": {"none": {"8": 100.0}, "scheduled": {"8": 97.0}},
              "ratio_vs_none": {"none": {"8": 1.0}, "scheduled": {"8": 0.97}},
              "full_step_ratio_vs_none_paired": {"none": {"8": 1.0}, "scheduled": {"8": 0.98}}, "ece": {}}
    md = render_markdown(result)
    assert "| scheduled | 97.0 (0.97x; 0.97x) |" in md and "| fixed |" not in md and "scheduled 0.98x" in md


def test_load_bench_table_shows_the_calibration_the_scheduled_policy_used():
    """The load bench's request stream is greedy: its scheduled policy runs on a calibration fitted on greedy
    rounds, and the Markdown shows it beside the T = 1 one (the ECE goal's figures)."""
    from dspark_core.bench_load import render_markdown
    cal = lambda raw, cal, n: {"raw": raw, "calibrated": cal, "rounds": n}   # noqa: E731
    result = {"concurrency": [1], "throughput": {p: {"1": 10.0} for p in ("none", "fixed", "scheduled")},
              "ratio_vs_none": {p: {"1": 1.0} for p in ("none", "fixed", "scheduled")},
              "ece": {"code": {**cal([0.05, 0.02], [0.01, 0.004], 300),
                               "stream": {"temperature": 0.0, **cal([0.11, 0.08], [0.03, 0.02], 280)}}}}
    md = render_markdown(result)
    assert "| code, T = 1 | 300 | 0.050, 0.020 | 0.010, 0.004 |" in md
    result["ece"]["code"]["crossfit"] = [0.031, 0.012]              # the out-of-sample column, when present
    assert "| 0.031, 0.012 |" in render_markdown(result)
    del result["ece"]["code"]["crossfit"]
    assert "| code, greedy (the scheduled policy's) | 280 | 0.110, 0.080 | 0.030, 0.020 |" in md
    # a result from before the greedy calibration (no "stream") still renders
    del result["ece"]["code"]["stream"]
    assert "greedy" not in render_markdown(result)


def test_step_cost_reads_a_split_profile_and_smooths_it():
    from dspark_core.scheduler import StepCost
    # 2 rows: B = 1 pads B = 2; B = 3, 4 draft 1, 2 rows; B = 5.. every row drafts (their median is n = 2)
    prof = {"rows": 2, "forward_seconds": [0.010, 0.010, 0.013, 0.012, 0.014, 0.015],
            "draft_seconds": [0.0, 0.0, 0.003, 0.005, 0.004, 0.006]}
    cost = StepCost.from_profile(prof)
    assert cost.forward == pytest.approx((0.010, 0.010, 0.0125, 0.0125, 0.014, 0.015))   # pooled, not a running max
    assert cost.draft == pytest.approx((0.003, 0.005))
    assert cost.forward_s(8) == pytest.approx(0.015 + 2 * 0.005 / 4)                 # linear past the profile
    assert cost.draft_s(0) == 0.0 and cost.draft_s(4) == pytest.approx(0.010)
    assert StepCost.from_profile({"sps": [1.0]}) is None
    assert StepCost.from_profile({**prof, "draft_seconds": [0.0] * 6}) is None         # no drafter profiled
    one = cost.shifted(1)                                                              # a lone row: as if 2
    assert one.rows == 1 and one.forward_s(1) == cost.forward_s(2) and one.draft == cost.draft[:1]


def test_split_cost_lets_a_confident_row_verify_its_whole_block():
    """Profiled as one curve with drafts spread over the rows, SPS(B) prices each token past the first as
    one more row's drafting pass, and the scheduled policy cut a confident row's block short; with the
    drafting pass apart, each further token costs its forward time only."""
    from dspark_core.scheduler import ScheduledPolicy, StepCost
    R, k = 4, 4
    fwd = lambda B: 0.030 + 0.0004 * max(0, B - R)                                    # noqa: E731
    drafting = lambda n: 0.003 + 0.004 * n                                            # noqa: E731
    # the single curve: at B = R + n (n <= R) n rows draft; past 2R all R do
    sps = SPSTable.monotone([1 / (fwd(B) + (drafting(min(B - R, R)) if B > R else 0.0)) for B in range(1, R * (k + 1) + 1)])
    cost = StepCost(R, tuple(fwd(B) for B in range(1, R * (k + 1) + 1)), tuple(drafting(n) for n in range(1, R + 1)))
    surv = [torch.tensor([0.5, 0.3, 0.2, 0.1]), None, None, None]
    limits = [k, 0, 0, 0]
    old = ScheduledPolicy({R: sps}, k=k)(surv, limits)
    new = ScheduledPolicy({R: sps}, k=k, costs={R: cost})(surv, limits)
    assert new == [4, 0, 0, 0] and old == [1, 0, 0, 0]
    # who drafts: the confident row's expected gain pays for its pass; a hopeless row's does not
    policy = ScheduledPolicy({R: sps}, k=k, costs={R: cost}, explore_every=100)
    prev = [torch.tensor([0.9, 0.8, 0.7, 0.6]), torch.tensor([0.05, 0.01, 0.0, 0.0]),
            torch.tensor([0.1, 0.02, 0.0, 0.0]), torch.tensor([0.02, 0.0, 0.0, 0.0])]
    assert policy.plan([0, 1, 2, 3], prev) == [True, False, False, False]
    # with a drafting pass dearer than anything the rows could gain, the step runs plain
    dear = StepCost(R, cost.forward, tuple(0.05 for _ in range(R)))
    policy = ScheduledPolicy({R: sps}, k=k, costs={R: dear}, explore_every=100)
    assert policy.plan([0, 1, 2, 3], prev) == [False] * 4
