"""The serving hand-off call on its own, and the flow CLI's argument errors (no flow runs here)."""

import pytest

from helpers import FakeServing, dead_url

from dspark_core.cli.main import main
from flows.handoff import notify_reload


def test_reload_call_posts_alias_with_bearer_token():
    serving = FakeServing()
    try:
        res = notify_reload(serving.url + "/", "math", "tok")
        assert res == {"ok": True, "url": f"{serving.url}/admin/drafters/math/reload", "status": 202}
        assert serving.calls == [{"path": "/admin/drafters/math/reload", "authorization": "Bearer tok",
                                  "json": {"alias": "champion"}}]
    finally:
        serving.close()


def test_reload_call_to_a_dead_url_reports_instead_of_raising():
    res = notify_reload(dead_url(), "code", None, timeout=2)
    assert res["ok"] is False and "ConnectError" in res["error"]


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
