"""The accelerator check (bench suite device) on a tiny target: every path lossless, the serving path timed."""


def test_device_check_finds_every_path_lossless_on_a_tiny_target():
    """`dspark bench --suite device` lossless stage, on CPU: plain = HF, speculative = plain at batch 1
    and in the batched engine with every verify length 0..7 in use."""
    from tiny_models import tiny_target
    from dspark_core.bench.device import _lossless
    target = tiny_target(vocab=96, layers=3)
    prompts = [[1, 5, 9, 3, 7], [2, 4, 6], [11, 12, 13, 14], [20, 30, 40, 50, 60, 70]]
    out = _lossless(target, prompts, 40, log=lambda *_: None)
    assert out["plain_equal_hf"] == out["dspark_equal_plain"] == out["ngram_equal_plain"] == 4
    assert out["batched_equal_plain"] == 4 and out["mismatches"] == []
    assert out["batched_verify_lengths"] == list(range(8))



def test_device_check_serving_path_is_lossless_and_timed_on_a_tiny_target():
    """`dspark bench --suite device` serving stage, on CPU: the live gate over the scheduled policy (drafter
    + prompt lookup, SPS tables profiled on the spot) gives plain greedy output, and the timing stage
    reports a scheduled ÷ none ratio for every concurrency and proposer."""
    from tiny_models import tiny_target
    from dspark_core.bench.device import _scheduled_lossless, _scheduled_load
    target = tiny_target(vocab=96, layers=3)
    prompts = [[1, 5, 9, 3, 7], [2, 4, 6], [11, 12, 13, 14], [20, 30, 40, 50, 60, 70]]
    out = _scheduled_lossless(target, prompts, 24, log=lambda *_: None)
    assert out["requests"] == 8 and out["equal_plain"] == 8 and out["mismatches"] == []
    load = _scheduled_load(target, prompts, 8, (1, 2), 1, log=lambda *_: None)
    for kind in ("dspark", "dspark-lookup"):
        assert set(load[kind]) == {"1", "2"}
        assert all(r["none_tok_s"] > 0 and r["scheduled_tok_s"] > 0 and r["ratio"] > 0 for r in load[kind].values())
