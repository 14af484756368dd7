"""The serving hand-off call on its own, and the flow CLI: argument errors, the table and the JSON it prints
(no flow runs here)."""

import json

import pytest

from helpers import FakeServing, dead_url

from dspark_core.cli.main import main
from flows.handoff import ReloadResult, notify_reload


def test_reload_call_posts_alias_with_bearer_token():
    serving = FakeServing()
    try:
        res = notify_reload(serving.url + "/", "math", "tok")
        assert res == ReloadResult(True, f"{serving.url}/admin/drafters/math/reload", status=202)
        assert res.to_dict() == {"ok": True, "url": f"{serving.url}/admin/drafters/math/reload", "status": 202}
        assert serving.calls == [{"path": "/admin/drafters/math/reload", "authorization": "Bearer tok",
                                  "json": {"alias": "champion"}}]
    finally:
        serving.close()


def test_reload_call_to_a_dead_url_reports_instead_of_raising():
    res = notify_reload(dead_url(), "code", None, timeout=2)
    assert res.ok is False and "ConnectError" in res.error and res.status is None


@pytest.mark.parametrize("argv, message", [
    (["flow", "run", "retrain", "--domains", "Bad Domain"], "bad domain 'Bad Domain'"),
    (["flow", "run", "retrain", "--set", "steps"], "is not KEY=VALUE"),
])
def test_bad_flow_arguments_give_one_line_and_a_hint(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    for k in ("PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"):
        monkeypatch.setenv(k, "")            # restored afterwards: the CLI fills unset Prefect defaults
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "hint:" in err


def test_flow_serve_registers_the_three_scheduled_deployments(capsys, tmp_path, monkeypatch):
    """`dspark flow serve` hands prefect.serve the hourly ingest, the nightly retrain and the drift retrain
    with the crons and parameters from its flags (prefect.serve itself, which blocks, is replaced)."""
    import prefect
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    for k in ("PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"):
        monkeypatch.setenv(k, "")
    got = {}
    monkeypatch.setattr(prefect, "serve", lambda *deps, **kw: got.update(deps=deps, kw=kw))
    code = main(["flow", "serve", "--retrain-cron", "15 2 * * *", "--domains", "code,math", "--quick"])
    assert code == 0, capsys.readouterr().err
    deps = {d.name: d for d in got["deps"]}
    assert set(deps) == {"hourly-ingest", "nightly-retrain", "drift-retrain"}
    crons = {name: [s.schedule.cron for s in d.schedules] for name, d in deps.items()}
    assert crons == {"hourly-ingest": ["0 * * * *"], "nightly-retrain": ["15 2 * * *"], "drift-retrain": ["30 * * * *"]}
    assert deps["nightly-retrain"].parameters == {"budget": "quick", "domains": ["code", "math"]}
    assert deps["drift-retrain"].parameters["drift_only"] is True


class _Result:
    """A flow result as the CLI receives it: an object with ``to_dict()``."""

    def __init__(self, data: dict):
        self.data = data

    def to_dict(self) -> dict:
        return self.data


RETRAIN = {"budget": "quick", "target_fingerprint": "f" * 64, "domains": ["code", "math"], "ingest": {}, "drift": None,
           "results": {
               "code": {"domain": "code", "version": 3, "model_uri": "models:/dspark-drafter-code/3",
                        "decision": "promoted", "promoted": True, "reasons": ["tau +0.40"],
                        "before": {"version": 2, "tau": 2.0, "speedup": 1.5, "ece_raw": None, "ece_calibrated": None},
                        "after": {"tau": 2.4, "speedup": 1.8, "ece_calibrated_worst": 0.03, "lossless_failures": 0},
                        "warm_start": "champion-v2"},
               "math": {"domain": "math", "version": 1, "model_uri": "models:/dspark-drafter-math/1",
                        "decision": "refused", "promoted": False, "reasons": ["ECE too high"], "before": None,
                        "after": {"tau": 2.1, "speedup": 1.2, "lossless_failures": 0}, "warm_start": "generic-x"}},
           "errors": {}, "seconds": 95.2, "report": "/home/reports/retrain.md"}
INGEST = {"files": 2, "skipped_files": 1, "read": 5, "stored": 4, "quarantined": 1, "duplicates": 0,
          "total_records": 9, "total_stored": 8, "total_quarantined": 1, "total_duplicates": 0, "total_trace_rows": 8,
          "total_quarantine_rows": 1, "trace_rows": 8, "domains": ["code", "math"]}
DRIFT = {"drifted": ["code"], "since": "2025-01-01T00:00:00+00:00", "margin": 0.1, "details": {
    "code": {"verdict": "drift: live tau 1.500 < 1.800 (champion 2.000 - 10%)", "live": {"tau": 1.5, "rounds": 300},
             "champion_version": 2, "champion_tau": 2.0},
    "chat": {"verdict": "no champion with an evaluated tau"}}}


@pytest.fixture
def fake_flows(tmp_path, monkeypatch):
    """``flow run`` against stand-in flows that return fixed results (no Prefect run, no model)."""
    import flows.retrain as retrain
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    for k in ("PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"):
        monkeypatch.setenv(k, "")
    monkeypatch.setattr(retrain, "retrain", lambda **kw: _Result(RETRAIN))
    monkeypatch.setattr(retrain, "drift_check", lambda **kw: _Result(DRIFT))
    monkeypatch.setattr(retrain, "ingest_traces", lambda: _Result(INGEST))


def test_flow_run_retrain_prints_a_row_per_domain_and_the_report(fake_flows, capsys):
    assert main(["flow", "run", "retrain", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["DOMAIN", "VERSION", "DECISION", "TAU", "BEFORE", "TAU", "SPEEDUP", "BEFORE",
                                "SPEEDUP", "ECE", "LOSSLESS", "FAILURES", "WARM", "START"]
    assert lines[1].split() == ["code", "3", "promoted", "2", "2.4", "1.5", "1.8", "0.03", "0", "champion-v2"]
    assert lines[2].split() == ["math", "1", "refused", "-", "2.1", "-", "1.2", "-", "0", "generic-x"]
    assert lines[3] == "report: /home/reports/retrain.md (95 s)"


def test_flow_run_json_is_the_flows_whole_result(fake_flows, capsys):
    assert main(["flow", "run", "retrain", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == RETRAIN
    assert main(["flow", "run", "drift", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == DRIFT


def test_flow_run_drift_prints_each_domains_verdict(fake_flows, capsys):
    assert main(["flow", "run", "drift"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["DOMAIN", "CHAMPION", "CHAMPION", "TAU", "LIVE", "TAU", "LIVE", "ROUNDS", "VERDICT"]
    assert lines[1].split()[:5] == ["code", "2", "2", "1.5", "300"] and lines[1].endswith("(champion 2.000 - 10%)")
    assert lines[2].split()[:5] == ["chat", "-", "-", "-", "-"]
    assert lines[3] == "drifted: code (margin 10%, live traces since 2025-01-01T00:00:00+00:00)"


def test_flow_run_ingest_prints_the_counts(fake_flows, capsys):
    assert main(["flow", "run", "ingest"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "FILES  READ  STORED  QUARANTINED  DUPLICATES  TRACE ROWS  DOMAINS",
        "    2     5       4            1           0           8  code,math"]
    assert main(["flow", "run", "ingest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == INGEST
