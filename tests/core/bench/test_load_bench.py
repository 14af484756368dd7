"""The load bench: chosen levels and policies, always its baseline, and its table."""

def test_load_bench_measures_chosen_levels_and_policies_and_always_its_baseline(tmp_path):
    """``--concurrency 16,8`` measures 8 and 16 (ascending); ``--policies scheduled`` runs scheduled beside the
    no-speculation baseline, which every ratio needs; the table shows only the policies that ran."""
    from dspark_core.bench.load import CONCURRENCY, POLICIES, RUN_ORDER, LoadBenchConfig, render_markdown
    from dspark_core.cli.bench import parse_levels, parse_policies
    assert parse_levels("16,8", CONCURRENCY) == (8, 16) and parse_policies("scheduled", POLICIES) == ("none", "scheduled")
    assert parse_levels(None, CONCURRENCY) == CONCURRENCY and parse_policies(None, POLICIES) == POLICIES
    assert parse_policies("none", POLICIES) == ("none",)
    # waves x c requests per level (at least 8); the smoke run sends c (at least 2)
    cfg = LoadBenchConfig(tmp_path, waves=6)
    assert [cfg.requests(c) for c in (1, 4)] == [8, 24]
    assert [LoadBenchConfig.quick(tmp_path).requests(c) for c in (1, 4)] == [2, 4]
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
    from dspark_core.bench.load import render_markdown
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
    # a result without the greedy calibration ("stream") still renders
    del result["ece"]["code"]["stream"]
    assert "greedy" not in render_markdown(result)
