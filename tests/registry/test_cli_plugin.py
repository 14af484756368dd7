"""The warehouse and registry verbs reach the dspark CLI through the entry-point plugin, with embedded
defaults: a table for a person by default, the same JSON keys as ever with --json."""

import json

import pytest

from dspark_core.cli.main import main
from dspark_core.data.traces import write_jsonl
from test_warehouse import rec


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return tmp_path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_warehouse_ingest_and_stats_under_dspark_home(home, capsys):
    (home / "landing" / "code").mkdir(parents=True)
    write_jsonl([rec(1), rec(2)], home / "landing" / "code" / "serving-0.jsonl")
    (home / "landing" / "code" / "broken.jsonl").write_text("{not json\n")
    code, out, _ = run(capsys, "warehouse", "ingest", "--json")
    first = json.loads(out)
    assert code == 0 and (first["read"], first["stored"], first["quarantined"]) == (3, 2, 1)
    assert set(first) == {"files", "skipped_files", "read", "stored", "quarantined", "duplicates", "warehouse_total"}
    assert (home / "traces.duckdb").exists()
    code, out, _ = run(capsys, "warehouse", "ingest")
    assert code == 0 and out.splitlines() == [
        "FILES  SKIPPED FILES  READ  STORED  QUARANTINED  DUPLICATES  WAREHOUSE TOTAL",
        "    2              2     0       0            0           0                2"]
    code, out, _ = run(capsys, "warehouse", "stats", "--json")
    stats = json.loads(out)
    assert code == 0 and set(stats) == {"records", "by_domain", "acceptance", "totals", "quarantine"}
    assert stats["by_domain"] == {"code": 2} and len(stats["quarantine"]) == 1
    assert set(stats["acceptance"]["code"]) == {"domain", "records", "rounds", "drafted", "verified", "accepted",
                                                "acceptance", "tau"}
    code, out, _ = run(capsys, "warehouse", "stats")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["DOMAIN", "RECORDS", "ROUNDS", "DRAFTED", "VERIFIED", "ACCEPTED",
                                              "ACCEPTANCE", "TAU"]
    assert lines[1].split() == ["code", "2", "0", "0", "0", "0", "-", "-"]
    assert "quarantine (first 1):" in lines and "broken.jsonl" in out
    code, out, _ = run(capsys, "registry", "list", "--json")
    assert code == 0 and json.loads(out) == {}
    assert (home / "mlflow.db").exists()
    code, out, _ = run(capsys, "registry", "list")
    assert code == 0 and out.strip() == "no registered drafters"


@pytest.fixture
def registered(home):
    """Two versions of the "code" drafter (tiny, seeded) in the registry under DSPARK_HOME, no champion."""
    from dspark_core.drafters import build_drafter, drafter_config, save_drafter
    from registry.cli import RegistrySettings
    from registry.mlflow_registry import DrafterRegistry
    from tiny_models import tiny_target
    target = tiny_target("llama", vocab=64, seed=2)
    s = RegistrySettings.from_env()
    reg = DrafterRegistry(s.tracking_uri, s.artifact_location)
    for seed, tau in ((7, 2.0), (8, 2.5)):
        model = build_drafter(drafter_config("dspark", target.runner.arch, "tiny"), target.runner, seed=seed)
        ck = save_drafter(model, home / f"ck{seed}", target.fingerprint)
        reg.register("code", ck, params={"steps": 150}, metrics={"tau": tau, "acceptance_per_position": [0.9, 0.7]})
    return reg


def test_registry_verbs_print_tables_and_one_line_confirmations(registered, capsys):
    code, out, _ = run(capsys, "registry", "list")
    rows = [line.split() for line in out.splitlines()]
    assert code == 0 and rows[0] == ["DOMAIN", "VERSION", "CHAMPION", "RUN", "ID", "MODEL", "URI"]
    assert [r[:2] for r in rows[1:]] == [["code", "1"], ["code", "2"]]

    code, out, _ = run(capsys, "registry", "promote", "code", "1")
    assert code == 0 and out == "code: champion is v1 (was none); reason: manual promotion\n"
    code, out, _ = run(capsys, "registry", "promote", "code", "2", "--reason", "higher tau", "--json")
    assert code == 0 and json.loads(out) | {"promoted_at": ""} == {
        "domain": "code", "version": 2, "previous_champion": 1, "promoted_at": "", "reason": "higher tau"}

    code, out, _ = run(capsys, "registry", "list", "--json")
    listing = json.loads(out)
    assert code == 0 and listing["code"]["champion"] == 2
    assert set(listing["code"]["versions"][0]) == {"name", "version", "run_id", "model_uri"}
    code, out, _ = run(capsys, "registry", "list")
    header, v1, v2 = out.splitlines()
    mark = slice(header.index("CHAMPION"), header.index("RUN ID"))
    assert (v1[mark].strip(), v2[mark].strip()) == ("", "yes")

    code, out, _ = run(capsys, "registry", "rollback", "code")
    assert code == 0 and out == "code: champion rolled back to v1\n"
    code, out, _ = run(capsys, "registry", "rollback", "code", "--json")
    assert code == 2            # v1 has no previous champion recorded


def test_registry_show_without_a_version_shows_the_champion(registered, capsys):
    code, _, err = run(capsys, "registry", "show", "code")
    assert code == 2 and err.splitlines() == [
        "error: domain 'code' has no champion",
        "hint: show a version (registered: v1, v2): dspark registry show code VERSION, or promote one: "
        "dspark registry promote code VERSION"]
    code, _, err = run(capsys, "registry", "show", "math")
    assert code == 2 and "no drafter is registered for domain 'math'" in err and "hint: " in err

    registered.promote("code", 2, "test")
    code, out, _ = run(capsys, "registry", "show", "code")
    lines = out.splitlines()
    assert code == 0 and "version    2" in lines and "aliases    challenger champion" in lines
    assert "model uri  models:/dspark-drafter-code/2" in lines
    assert "tau                      2.5" in out and "acceptance_per_position  0.9 0.7" in out
    assert "promotion_reason" in out and "steps" in out

    code, out, _ = run(capsys, "registry", "show", "code", "--json")
    champion = json.loads(out)
    assert code == 0 and champion["version"] == 2 and champion["metrics"]["tau"] == 2.5
    assert set(champion) == {"name", "version", "run_id", "model_uri", "created", "aliases", "tags", "params",
                             "metrics"}
    code, out, _ = run(capsys, "registry", "show", "code", "1", "--json")
    assert code == 0 and json.loads(out)["version"] == 1 and json.loads(out)["aliases"] == []
    code, _, err = run(capsys, "registry", "show", "code", "7")
    assert code == 2 and "has no version 7" in err and "hint: list the registered versions" in err


def test_registry_export_serves_the_registered_speculators_folder(home, capsys, tmp_path):
    """A version registered with its speculators export hands that folder out as is (the verifier can be
    renamed for the serving hosts); an unknown alias is one error line."""
    from dataclasses import replace

    from dspark_core.drafters import build_drafter, drafter_config, save_drafter
    from dspark_core.formats import export_drafter
    from registry.cli import RegistrySettings
    from registry.mlflow_registry import DrafterRegistry
    from tiny_models import tiny_target
    target = tiny_target("qwen3", vocab=64, seed=2)
    target.reference.save_pretrained(tmp_path / "verifier")
    target = replace(target, path=tmp_path / "verifier")
    model = build_drafter(drafter_config("dspark", target.runner.arch, "tiny"), target.runner, seed=7)
    ck = save_drafter(model, home / "ck", target.fingerprint)
    spec = export_drafter(ck, target, "speculators", tmp_path / "spec")
    s = RegistrySettings.from_env()
    reg = DrafterRegistry(s.tracking_uri, s.artifact_location)
    rv = reg.register("code", ck, params={}, metrics={"tau": 2.0}, exports={"speculators": spec})
    reg.promote("code", rv.version, "first")

    out = tmp_path / "fleet"
    code, stdout, _ = run(capsys, "registry", "export", "code", "--format", "speculators", "--out", str(out),
                          "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct", "--json")
    row = json.loads(stdout)
    assert code == 0 and row["source"] == "registered export" and row["version"] == rv.version
    assert (out / "model.safetensors").read_bytes() == (spec / "model.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["speculators_model_type"] == "dspark"

    code, _, err = run(capsys, "registry", "export", "code", "--alias", "nope", "--format", "speculators",
                       "--out", str(tmp_path / "x"))
    assert code == 2 and "no alias 'nope'" in err
    code, _, err = run(capsys, "registry", "export", "code", "--format", "speculators", "--out", str(out))
    assert code == 2 and "not empty" in err


def test_a_locked_warehouse_is_one_cli_line_with_exit_code_2(home, capsys):
    import subprocess
    import sys
    import time
    db = home / "traces.duckdb"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from registry.warehouse import TraceWarehouse\n"
        f"w = TraceWarehouse({str(db)!r}); print('open', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        code, out, err = run(capsys, "warehouse", "ingest")
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert lines[0].startswith("error: cannot open the trace warehouse") and lines[1].startswith("hint: ")
        assert "Traceback" not in err
    finally:
        holder.kill()
        holder.wait(10)
    time.sleep(0.1)
