"""The HTTP serve bench's summary and table."""

from dspark_core.scheduling import LiveGate


def test_serve_bench_summary_takes_medians_over_repetitions():
    from serving.bench import _summary

    def req(n, wall, ttft, info=None):
        return {"tokens": list(range(n)), "wall": wall, "ttft": ttft, "itl": [wall / n] * (n - 1), "info": info or {}}
    runs = [{"res": [req(10, 1.0, 0.1), req(10, 2.0, 0.2)], "wall": 2.0},        # 10 tok/s, per-user median 7.5
            {"res": [req(10, 0.5, 0.1), req(10, 0.5, 0.1)], "wall": 0.5},        # 40 tok/s, 20
            {"res": [req(10, 1.0, 0.3, {"drafted": 8, "accepted": 4, "rounds": 5}),
                     req(10, 1.0, 0.3)], "wall": 1.0}]                          # 20 tok/s, 10
    s = _summary(runs)
    assert s["reps"] == 3 and s["requests"] == 2
    assert s["output_tok_s"] == 20.0 and s["output_tok_s_reps"] == [10.0, 40.0, 20.0]
    assert s["per_user_tok_s"] == 10.0
    assert s["acceptance"] == 0.5 and s["tokens_per_round"] == 12.0        # 60 tokens / 5 rounds reported
    assert s["outputs"] == [list(range(10))] * 2 and s["ttft_ms"]["p50"] > 0



def test_serve_bench_table_reports_the_gate_at_each_levels_bucket():
    """The serve bench reads the DSpark server's live gate after each level (admin API); its table says how
    many steps of that level's bucket (c = 3 falls in bucket 4) speculated, from a real gate's state."""
    from serving.bench import render_markdown

    gate = LiveGate(None, explore_every=4, window=1)
    for i in range(40):                                  # 4 rows: speculation makes 3 tokens a step against 6
        arm = gate.choose(3)
        gate.last_arm = arm
        gate.observe(3, 3 if arm == "spec" else 6, 0.01)
    state = gate.describe()
    at = state["4"]
    assert at["running"] == "plain" and at["spec"]["steps"] >= 1 and at["plain"]["steps"] > at["spec"]["steps"]
    mode = {"output_tok_s": 1.0, "per_user_tok_s": 1.0, "ttft_ms": {"p50": 1, "p90": 1},
            "itl_ms": {"p50": 1, "p90": 1, "p99": 1}, "tokens_per_round": 1.0, "acceptance": None}
    result = {"concurrency": [3], "modes": {"none": {"3": mode}, "dspark": {"3": mode}},
              "ratio_dspark_vs_none": {"3": {"output": 1.0, "per_user": 1.0}}, "greedy_output_mismatches": {"3": 0},
              "dtype": "float32", "notes": "n", "gate": {"3": state}}
    text = render_markdown(result)
    assert (f"c = 3: {at['spec']['steps']} speculative / {at['plain']['steps']} plain steps "
            f"(bracket {at['spec_vs_plain']}, running plain; a bracket costs {at['bracket_cost_steps']} steps, "
            f"next after {at['explore_interval']})") in text
    assert at["bracket_cost_steps"] > 0 and at["explore_interval"] > 4
    assert "Live gate" not in render_markdown({**result, "gate": {"3": None}})    # a policy without a gate


def test_serve_bench_builds_its_config_from_the_checked_options_and_errors_through_the_kit(tmp_path):
    """The plugin suite is handed the CLI's checked options, its settings and the CommandKit; it builds its
    own frozen config (the quick run: levels 1 and 4, one repetition) and reports a missing drafter as
    ``kit.error``, without importing the CLI or the core bench package."""
    import argparse
    from types import SimpleNamespace

    import pytest

    from serving.bench import CONCURRENCY, WAVES, ServeBenchConfig, run

    class KitError(Exception):
        def __init__(self, message, hint=""):
            super().__init__(message)
            self.hint = hint

    opts = dict(target="t", model=None, dtype="auto", device="cpu", checkpoint=None, quick=False, reps=None,
                waves=None, max_new_tokens=None, block_size=None, prompt_lookup=False)
    full = ServeBenchConfig.from_args(argparse.Namespace(**opts), tmp_path, tmp_path / "ck")
    assert full.concurrency == CONCURRENCY and full.waves == WAVES and full.reps == 3
    assert [full.requests(c) for c in (1, 4, 16)] == [8, 12, 48]
    quick = ServeBenchConfig.from_args(argparse.Namespace(**{**opts, "quick": True}), tmp_path, tmp_path / "ck")
    assert quick.concurrency == (1, 4) and quick.reps == 1 and quick.max_new_tokens == 32 and quick.requests(1) == 2
    kit = SimpleNamespace(error=KitError, load_target=None, log=lambda *_: None)
    with pytest.raises(KitError, match="no trained code drafter") as err:
        run(argparse.Namespace(**opts), SimpleNamespace(home=tmp_path), kit)
    assert "--checkpoint" in err.value.hint
