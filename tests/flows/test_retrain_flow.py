"""The retraining flows end to end on a tiny target: registration, idempotent reruns, the gate through
the flow, a foreign-target drafter refused, the drift trigger and the hand-off to serving.

Hermetic: tiny seeded target and traces, MLflow/DuckDB/results in temporary folders, one Prefect test
harness per session. The tests of this module share one pipeline home and run in file order (the
first retrain makes the champions the later tests compete with).
"""

import json

import pytest

from helpers import make_home
from helpers import (DOMAINS, FakeServing, dead_url, flow_env, journal_steps, land, landing_lines, make_records,
                     setenv)

from dspark_core.pipeline.steps import Budget
from dspark_core.drafters import DrafterMismatchError, build_drafter, drafter_config, save_drafter
from dspark_core.data.traces import RoundStat
from flows.results import Challenger
from flows.retrain import calibrate, drift_check, evaluate_and_promote, retrain, train_domain_drafter
from registry.cli import RegistrySettings
from registry.mlflow_registry import DrafterRegistry
from registry.warehouse import TraceWarehouse


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, tiny_model_dir, tiny_records):
    target, records = tiny_records
    home = make_home(tmp_path_factory.mktemp("pipeline-home"), tiny_model_dir, records)
    with pytest.MonkeyPatch.context() as mp:
        setenv(mp, flow_env(home))
        mp.setenv("DSPARK_SERVER_URL", dead_url())          # the first promotions hand off to nobody
        first = retrain(domains=list(DOMAINS), budget="tiny", max_ece=1.0)
        mp.delenv("DSPARK_SERVER_URL")
        s = RegistrySettings.from_env()
        yield {"home": home, "first": first, "target": target, "reg": DrafterRegistry(s.tracking_uri, s.artifact_location)}


def _snapshot(home, domain, split):
    paths = sorted((home / "flows" / "data").glob(f"{domain}-*/{split}.jsonl"))
    assert paths, f"no {split} snapshot for {domain}"
    return str(paths[0])


def _tiny(**overrides) -> Budget:
    return Budget.preset_named("tiny", **overrides)


def test_retrain_registers_a_champion_per_domain_with_metrics_artifacts_and_tags(pipe, tmp_path):
    home, reg, first = pipe["home"], pipe["reg"], pipe["first"]
    assert sorted(first.results) == list(DOMAINS) and not first.errors
    for d in DOMAINS:
        out = first.results[d]
        assert (out.version, out.decision, out.promoted) == (1, "promoted", True)
        assert out.warm_start.startswith("generic-")
        assert out.handoff.ok is False and "ConnectError" in out.handoff.error   # only a warning
        assert [v.version for v in reg.versions(d)] == [1] and reg.champion(d).version == 1
        info = reg.version_info(d, 1)
        m = info.metrics
        assert m["tau"] >= 1.0 and m["lossless_failures"] == 0 and m["speedup"] > 0 and "train_loss" in m
        assert len(m["ece_calibrated"]) == len(m["ece_raw"]) == 4 and len(m["acceptance_per_position"]) == 4
        assert out.after["tau"] == m["tau"]
        tags = info.tags
        assert tags["target_fingerprint"] == pipe["target"].fingerprint and int(tags["trace_count"]) > 0
        assert "/" in tags["trace_window"] and tags["code_version"] and tags["data_key"]
        got = reg.download(d, "champion", tmp_path / d)
        assert (got / "checkpoint" / "model.safetensors").exists() and (got / "checkpoint" / "config.json").exists()
        assert json.loads((got / "calibration.json").read_text())["target_fingerprint"] == pipe["target"].fingerprint
        assert len(json.loads((got / "sps.json").read_text())["sps"]) == 3
        plots = sorted(a.path for a in reg.client.list_artifacts(info.run_id, "plots"))
        assert plots == ["plots/calibration-" + d + ".png", "plots/sps.png"]
    with TraceWarehouse(home / "traces.duckdb", read_only=True) as wh:
        t = wh.totals()
    assert t.trace_rows == t.stored == landing_lines(home) == 48
    assert t.records == t.stored + t.quarantined + t.duplicates
    report = open(first.report).read()
    assert "| code | v1 | promoted |" in report and "data:image/png;base64," in report
    as_json = json.loads(json.dumps(first.to_dict()))              # the CLI's --json: plain JSON, same keys
    assert set(as_json) == {"budget", "target_fingerprint", "domains", "ingest", "drift", "results", "errors",
                            "seconds", "report"}
    assert as_json["ingest"]["trace_rows"] == 48 and as_json["results"]["code"]["handoff"]["ok"] is False
    starts = journal_steps(home)
    assert [starts.count(f"train-{d}") for d in ("generic", *DOMAINS)] == [1, 1, 1]


def test_rerun_redoes_no_step_and_adds_no_version_or_row(pipe):
    home, reg = pipe["home"], pipe["reg"]
    before = journal_steps(home)
    again = retrain(domains=list(DOMAINS), budget="tiny", max_ece=1.0)
    assert journal_steps(home) == before                       # every compute step came back cached
    assert {d: o.decision for d, o in again.results.items()} == {d: "already champion" for d in DOMAINS}
    assert again.ingest.stored == 0 and again.ingest.trace_rows == 48
    assert all([v.version for v in reg.versions(d)] == [1] for d in DOMAINS)


def test_gate_refuses_a_worse_challenger_and_promotes_a_better_one_with_a_handoff(pipe, monkeypatch):
    home, reg, target = pipe["home"], pipe["reg"], pipe["target"]
    serving = FakeServing()
    monkeypatch.setenv("DSPARK_SERVER_URL", serving.url)
    monkeypatch.setenv("DSPARK_ADMIN_TOKEN", "s3cret")
    heldout, train = _snapshot(home, "code", "heldout"), _snapshot(home, "code", "train")
    try:
        worse = save_drafter(build_drafter(drafter_config("dspark", target.runner.arch, "tiny", block_size=4),
                                           target.runner, seed=123), home / "worse", target.fingerprint)
        cal = calibrate("code", str(worse), heldout, _tiny(), key="worse")
        out = evaluate_and_promote("code", Challenger(str(worse), heldout, calibration=cal), _tiny(), max_ece=1.0)
        assert out.decision == "refused" and out.version == 2
        assert any(" < " in r and r.startswith("tau") for r in out.reasons), out.reasons
        assert reg.champion("code").version == 1 and reg.get_alias("code", "challenger").version == 2
        assert serving.calls == []
        init = reg.download("code", "champion", home / "champion-code") / "checkpoint"
        better = train_domain_drafter("code", [train], str(home / "better"), _tiny(steps=300, lr=3e-3), 300,
                                      key="better", init=str(init))
        cal = calibrate("code", better.checkpoint, heldout, _tiny(), key="better")
        out = evaluate_and_promote("code", Challenger(better.checkpoint, heldout, calibration=cal, train=better),
                                   _tiny(), max_ece=1.0)
        assert out.decision == "promoted", out.reasons
        assert out.after["tau"] >= 1.02 * out.before.tau and out.before.version == 1
        # the challenger ÷ champion, re-measured in the same run, registered with its range over the prompts
        lo, mid, hi = (out.after[k] for k in ("tau_vs_champion_low", "tau_vs_champion", "tau_vs_champion_high"))
        assert lo <= mid <= hi and mid == pytest.approx(out.after["tau"] / out.before.tau, abs=2e-3)
        assert out.after["speedup_low"] <= out.after["speedup"] <= out.after["speedup_high"]
        assert reg.champion("code").version == 3
        assert reg.version_info("code", 3).tags["previous_champion"] == "1"
        assert serving.calls == [{"path": "/admin/drafters/code/reload", "authorization": "Bearer s3cret",
                                  "json": {"alias": "champion"}}]
        assert out.handoff.ok is True
    finally:
        serving.close()


def test_a_drafter_for_another_target_is_refused(pipe, tiny_model_dir, tmp_path):
    from tiny_models import tiny_target
    home, reg = pipe["home"], pipe["reg"]
    other = tiny_target("llama", vocab=64, seed=9)
    foreign = save_drafter(build_drafter(drafter_config("dspark", other.runner.arch, "tiny", block_size=4),
                                         other.runner, seed=1), tmp_path / "foreign", other.fingerprint)
    versions = [v.version for v in reg.versions("math")]
    with pytest.raises(DrafterMismatchError, match="refused: drafter .* trained for target"):
        evaluate_and_promote("math", Challenger(str(foreign), _snapshot(home, "math", "heldout")), _tiny(),
                             max_ece=1.0)
    assert [v.version for v in reg.versions("math")] == versions and reg.champion("math").version == 1


def test_drift_check_picks_the_domain_whose_live_acceptance_fell_and_retrains_only_it(pipe, monkeypatch):
    home, reg, target = pipe["home"], pipe["reg"], pipe["target"]
    runner, fp = target.runner, target.fingerprint
    bad = [RoundStat(drafted=4, verified=4, accepted=0, full_verify=True)] * 5     # live tau 1.0
    good = [RoundStat(drafted=4, verified=4, accepted=4, full_verify=True)] * 5    # live tau 5.0
    land(home, make_records(runner, fp, "code", 6, seed=50, source="serving", rounds=bad)
         + make_records(runner, fp, "math", 6, seed=51, source="serving", rounds=good), "serving-0001",
         heldout_fraction=None)
    champ_tau = reg.champion_info("code").metrics["tau"]
    assert champ_tau * 0.9 > 1.0, "the code champion must be good enough for a drop to show"
    from flows.retrain import ingest_traces
    ingest_traces()
    verdict = drift_check(margin=0.1, min_rounds=5)
    assert verdict.drifted == ["code"], verdict.details
    assert verdict.details["math"].verdict.startswith("ok") and verdict.details["code"].live.tau == 1.0
    assert drift_check(margin=0.1, min_rounds=1000).drifted == []               # too little evidence
    # serving's live ECE of the shipped calibration also counts, when a server is configured
    from flows import tasks
    from flows.handoff import LiveCalibrationState
    monkeypatch.setenv("DSPARK_SERVER_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(tasks, "serving_live_calibration", lambda url, d, token: LiveCalibrationState(
        400, (0.02, 0.09) if d == "math" else (0.01, 0.01), (0.01, 0.01)))
    by_ece = drift_check(margin=0.1, min_rounds=5, max_live_ece=0.05)
    assert by_ece.drifted == ["code", "math"], by_ece.details
    assert by_ece.details["math"].verdict.startswith("drift: live ECE of the shipped calibration 0.090 > 0.050")
    assert by_ece.to_dict()["details"]["math"]["live_calibration"]["ece_shipped"] == [0.02, 0.09]
    assert drift_check(margin=0.1, min_rounds=5, max_live_ece=0.10).drifted == ["code"]
    monkeypatch.delenv("DSPARK_SERVER_URL")
    versions = {d: [v.version for v in reg.versions(d)] for d in DOMAINS}
    monkeypatch.setenv("DSPARK_DRIFT_MIN_ROUNDS", "5")
    out = retrain(budget="tiny", drift_only=True, max_ece=1.0)
    assert out.domains == ["code"] and list(out.results) == ["code"]
    assert out.results["code"].warm_start.startswith("champion-v")
    assert len(reg.versions("code")) == len(versions["code"]) + 1
    assert [v.version for v in reg.versions("math")] == versions["math"]
