"""The calibration-drift bench end to end on the tiny target: both arms run the same script, the JSON carries
the fields the issue names, and the table renders."""

import json
from dataclasses import replace

from dspark_core.drafters import save_drafter
from serving.drift_bench import (DriftBenchConfig, calibration_drift, fit_shipped_calibration, render_markdown,
                                 render_replay, replay_rounds)
from serving_helpers import peaky_dspark


def test_the_drift_bench_runs_both_arms_and_reports_ece_and_throughput(tiny, tmp_path):
    ckpt = tmp_path / "ckpt"
    save_drafter(peaky_dspark(tiny, 7).drafter, ckpt, tiny.fingerprint)
    tok = tiny.tokenizer
    before = [tok(p).input_ids for p in ("def add(a, b):", "for i in range(10):", "import os\nprint(")]
    after = [tok(p).input_ids for p in ("hello there, how are you?", "the cat sat on the mat", "what time is it")]
    # the fixed policy speculates every step whatever this host's timings say, so every round is labelled
    cfg = replace(DriftBenchConfig.quick(), block=4, shadow_fraction=1.0, live_refit_every=8, live_min_rounds=8,
                  after_c1_requests=24, policy="fixed", final_window=100_000)
    shipped = fit_shipped_calibration(tiny, ckpt, before, cfg)
    lines = []
    res = calibration_drift(tiny, ckpt, shipped, None, before, after, cfg, tmp_path / "home", log=lines.append,
                            rounds_dir=tmp_path / "rounds")
    json.dumps(res)
    assert set(res["ece_after_shift"]) >= {"live", "stale"} and set(res["throughput_ratio"]) == {"1", "8"}
    for arm in ("live", "stale"):
        a = res["arms"][arm]
        assert a["phases"]["after_c8"]["requests"] == cfg.after_requests and a["phases"]["after_c8"]["errors"] == 0
        assert a["phases"]["after_c1"]["tokens"] == cfg.after_c1_requests * cfg.max_new_tokens
        assert a["phases"]["before"]["concurrency"] == a["phases"]["after_c1"]["concurrency"] == 1
        assert a["rounds_after_shift"] > 0 and a["curve"]
    # the final ECE reads every labelled round after the shift, more than the calibrator's window holds
    assert res["ece_after_shift"]["rounds"] == res["arms"]["live"]["rounds_after_shift"] > cfg.live_window
    assert res["arms"]["stale"]["refits"] == 0 and res["arms"]["stale"]["version"] == 0
    # each arm's figure comes with its spread over block-bootstrap resamples, laid around the figure
    for arm in ("live", "stale"):
        lo, hi = res["ece_after_shift"][f"{arm}_spread"]
        assert lo <= res["ece_after_shift"][arm] <= hi and hi > lo
    # the arms take turns chunk by chunk, the same requests on both: paired ratios per phase
    assert len(res["arms"]["live"]["phases"]["after_c1"]["chunks"]) == 24 // cfg.chunk_c1
    assert set(res["throughput_ratio_paired_median"]) == {"before", "after_c1", "after_c8"}
    assert "paired chunks" in render_markdown(res)
    # the refits' CPU time per phase: the live arm's only (the stale arm never fits)
    live_fit = [res["arms"]["live"]["phases"][k]["fit_seconds"] for k in ("before", "after_c1", "after_c8")]
    assert sum(live_fit) > 0 and sum(live_fit) <= res["arms"]["live"]["fit_seconds"] + 0.02   # 3 phases, 0.01 each
    assert res["arms"]["stale"]["fit_seconds"] == 0 and res["arms"]["live"]["refit_interval"] >= cfg.live_refit_every
    assert all("version" in p and "live_per_position" in p for p in res["arms"]["live"]["curve"])
    text = render_markdown(res)
    assert "5-95 % over resamples" in text
    assert "worst-position ECE" in text and "c = 8" in text and "c = 1" in text and "live refits' CPU time" in text
    assert any("live:" not in line and "stale" in line for line in lines)
    assert res["config"]["shift"] == "temperature" and res["config"]["after_temperature"] == 1.0

    # each arm's labelled rounds are saved; replayed at the recorded window they give the run's live figure
    import torch
    rounds = {arm: torch.load(tmp_path / "rounds" / f"rounds-{arm}.pt") for arm in ("live", "stale")}
    live = rounds["live"]
    assert live["conf"].shape[0] - live["shift_at"] == res["arms"]["live"]["rounds_after_shift"]
    assert live["conf"].shape == (live["accepted"].shape[0], len(res["arms"]["live"]["final"]["live"]))
    rep = {arm: replay_rounds(r, windows=(16, 64), log=lines.append) for arm, r in rounds.items()}
    windows = [w["window"] for w in rep["live"]["windows"]]
    assert windows == [16, 64, cfg.live_window]
    recorded = rep["live"]["windows"][-1]
    assert recorded["minus_recorded_window"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    # the replay refits inline where the server swapped a few rounds later: close to the run's own figure
    assert abs(recorded["worst"] - res["ece_after_shift"]["live"]) < 0.1
    text = render_replay({"arms": rep})
    assert "| 16 |" in text and "recorded with a 256-round window" in text


def test_the_replay_suite_without_a_drafter_or_recorded_rounds_says_what_to_run(tmp_path, monkeypatch, capsys):
    from dspark_core.cli.main import main
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    assert main(["bench", "--suite", "calibration-replay"]) == 2
    err = capsys.readouterr().err
    assert "no trained code drafter" in err and "hint:" in err and "Traceback" not in err
