"""The registry verbs reach the dspark CLI through the entry-point plugin, with embedded defaults."""

import json

from dspark_core.cli.main import main
from dspark_core.data.traces import write_jsonl
from test_warehouse import rec


def test_warehouse_ingest_and_stats_under_dspark_home(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    (tmp_path / "landing" / "code").mkdir(parents=True)
    write_jsonl([rec(1), rec(2)], tmp_path / "landing" / "code" / "serving-0.jsonl")
    (tmp_path / "landing" / "code" / "broken.jsonl").write_text("{not json\n")
    assert main(["warehouse", "ingest", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["read"], first["stored"], first["quarantined"]) == (3, 2, 1)
    assert (tmp_path / "traces.duckdb").exists()
    assert main(["warehouse", "ingest", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["stored"] == 0 and again["warehouse_total"] == 2
    assert main(["warehouse", "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["by_domain"] == {"code": 2} and len(stats["quarantine"]) == 1
    assert main(["registry", "list"]) == 0
    assert json.loads(capsys.readouterr().out) == {}
    assert (tmp_path / "mlflow.db").exists()
