"""Calibration: ECE, AUROC, Brier, Sequential Temperature Scaling (+ shift) and cross-fitting."""

import pytest
import torch

from dspark_core.calibration import (Calibration, STSConfig, auroc, brier, crossfit_metrics, ece, ece_floor,
                                     fit_sts, prefix_labels, survival, worst_ece_spread)


def test_ece_matches_a_hand_worked_example():
    # 4 bins of width 0.25. Bin 0: preds .1,.2 labels 0,1 -> |.15 - .5| = .35, weight 2/6.
    # Bin 2: preds .6 label 1 -> |.6 - 1| = .4, weight 1/6. Bin 3: .8,.9,.95 labels 1,1,0 -> |.8833 - .6667|.
    pred = torch.tensor([0.1, 0.2, 0.6, 0.8, 0.9, 0.95])
    label = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    expect = (2 * 0.35 + 1 * 0.4 + 3 * abs((0.8 + 0.9 + 0.95) / 3 - 2 / 3)) / 6
    assert ece(pred, label, bins=4) == pytest.approx(expect, abs=1e-6)
    assert ece(pred, label, bins=4, min_count=2) == pytest.approx((2 * 0.35 + 3 * abs(2.65 / 3 - 2 / 3)) / 5,
                                                                 abs=1e-6)



def test_worst_ece_spread_covers_what_other_samples_of_the_same_traffic_read():
    """Traffic whose requests differ (each request's rounds share a logit offset) and a predictor that knows
    only the pooled rate. The spread of one sample, laid around its own figure, covers the median of 30
    other samples' worst-position ECE and is about as wide as their 5-95 % range; resampling single rounds
    (no blocks) ignores that a request's rounds move together and comes out narrower; four times the
    rounds narrow it."""
    G, per_request = 2, 24

    def sample(requests: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(requests * per_request, G, generator=g)
        offset = (0.8 * torch.randn(requests, 1, generator=g)).repeat_interleave(per_request, 0)
        label = (torch.rand(z.shape, generator=g) < torch.sigmoid(z + offset)).float()
        pred = torch.sigmoid(z / 1.25)              # roughly the pooled rate given z
        return torch.cumprod(pred, 1), torch.cumprod(label, 1)

    others = torch.tensor([max(ece(p[:, k], y[:, k]) for k in range(G))
                           for p, y in (sample(150, 100 + s) for s in range(30))])
    lo_o, med_o, hi_o = (float(x) for x in torch.quantile(others, torch.tensor([0.05, 0.5, 0.95])))
    p, y = sample(150, 1)
    lo, hi = worst_ece_spread(p, y, block=48)
    measured = max(ece(p[:, k], y[:, k]) for k in range(G))
    assert lo <= measured <= hi
    assert lo <= med_o <= hi
    assert 0.7 < (hi - lo) / (hi_o - lo_o) < 1.4
    lo1, hi1 = worst_ece_spread(p, y, block=1)
    assert hi1 - lo1 < 0.85 * (hi - lo)
    p4, y4 = sample(600, 2)
    lo4, hi4 = worst_ece_spread(p4, y4, block=48)
    assert (hi4 - lo4) < 0.75 * (hi - lo)
    assert worst_ece_spread(p, y, block=48) == [lo, hi]              # seeded
    assert worst_ece_spread(torch.empty(0, G), torch.empty(0, G)) == [0.0, 0.0]


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
    cal = fit_sts(g, acc, STSConfig(shift=True))
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



def test_sts_keeps_t_1_where_a_position_has_no_evidence():
    g, acc = _synthetic(2000, [1.0, 1.0, 1.0])
    acc = acc.clamp(max=1)                       # nobody ever gets past position 1
    cal = fit_sts(g, acc)
    assert cal.temperatures[1:] == [1.0, 1.0]


def _synthetic(n, true_t, G=3, seed=0, true_b=None):
    """Rounds whose true per-step acceptance is sigmoid(g / true_t[k] + true_b[k]); the head reports g."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, G, generator=gen) * 2.0 + 1.0
    p = torch.sigmoid(g / torch.tensor(true_t) + torch.tensor(true_b or [0.0] * G))
    ok = torch.rand(n, G, generator=gen) < p
    accepted = torch.cumprod(ok.int(), dim=-1).sum(-1)
    return g, accepted


def test_ece_rows_scores_each_row_as_ece_does():
    """The STS search scores thousands of candidates at once (:func:`ece_rows`); each row's score is the
    :func:`ece` of that row, with the same minimum bin count, including rows whose bins all fall short."""
    from dspark_core.calibration import ece, ece_rows
    g = torch.Generator().manual_seed(3)
    label = (torch.rand(500, generator=g) < 0.6).float()
    pred = torch.rand(40, 500, generator=g) ** torch.linspace(0.2, 3.0, 40)[:, None]
    pred[0] = 0.999                                          # one bin only
    pred[1, :] = torch.linspace(0, 1, 500)
    for min_count in (1, 10, 60):
        rows = ece_rows(pred, label, 15, min_count)
        assert rows.shape == (40,)
        for p in range(40):
            assert rows[p].item() == pytest.approx(ece(pred[p], label, 15, min_count), abs=1e-5)
    assert ece_rows(pred[:, :0], label[:0]).tolist() == [0.0] * 40


def test_the_refined_search_fits_as_well_as_the_full_grid_at_a_fraction_of_the_pairs():
    """``search="refine"`` (the live calibrator's) scores a coarse grid and the neighbourhoods of its best
    pairs: on seeded rounds its calibrated ECE per position stays within 1e-3 of the full grid's, from
    under a fifth of the pairs; an unknown search is refused."""
    from dspark_core import calibration as cal_mod
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        conf = torch.randn(1600, 5, generator=g) * 2 + 0.5
        ok = torch.rand(1600, 5, generator=g) < torch.sigmoid(conf / (1.5 + seed) - 0.4 + 0.3 * seed)
        acc = torch.cumprod(ok.int(), 1).sum(1)
        full = fit_sts(conf, acc, STSConfig(shift=True))
        refined = fit_sts(conf, acc, STSConfig(shift=True, search="refine"))
        for a, b in zip(refined.calibrated, full.calibrated):
            assert a["ece"] <= b["ece"] + 1e-3
    cfg = STSConfig(shift=True, search="refine")
    scored = cal_mod._search_pairs(conf[:, 0], torch.ones(1600), prefix_labels(acc, 5)[:, 0], cfg.grid,
                                   cfg.shift_grid, cfg)
    assert (1.0, 0.0) in scored and len(scored) * 5 < len(cfg.grid) * len(cfg.shift_grid)
    with pytest.raises(ValueError, match="search"):
        fit_sts(conf, acc, STSConfig(search="random"))
