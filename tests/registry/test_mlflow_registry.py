"""MLflow drafter registry: registration, aliases, promotion/rollback, pyfunc loading, the gate.

Hermetic: a sqlite store and an artifact folder in a temporary directory, tiny seeded drafters on a
tiny random target, no server, no downloads. One registry (two versions of domain "code") is shared
by the module because every log_model costs about a second.
"""

import json
import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")   # before mlflow is imported

import mlflow
import pytest
import torch

from dspark_core.drafters import (BlockProposer, DrafterMismatchError, build_drafter, build_proposer,
                                   drafter_config, save_drafter)
from dspark_core.engine.sampling import SamplingParams
from registry.mlflow_registry import (DrafterRegistry, GateDecision, ModelVersionInfo, RegistryError, gate,
                                      load_drafter_from_registry, model_name)
from tiny_models import tiny_target

CAL = {"temperatures": [1.0, 1.5, 2.0], "rounds": 300, "raw": [], "calibrated": [], "drafter": "dspark",
       "target_fingerprint": "", "fallback": False}
SPS = {"sps": [50.0, 49.0, 47.5], "measured": [50.0, 49.0, 47.5], "hardware": {"device": "cpu", "dtype": "float32"}}


def metrics(tau: float) -> dict:
    return {"tau": tau, "acceptance_per_position": [0.9, 0.7, 0.5], "ece_raw": [0.08, 0.1, 0.12],
            "ece_calibrated": [0.01, 0.02, 0.015], "speedup": 1.7, "train_loss": 0.42, "lossless_failures": 0}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow")
    target = tiny_target("llama", vocab=64, seed=2)
    ckpts = []
    for seed in (7, 8):
        model = build_drafter(drafter_config("dspark", target.runner.arch, "tiny"), target.runner, seed=seed)
        ckpts.append(save_drafter(model, tmp / f"ck{seed}", target.fingerprint, extra={"trace_count": 120}))
    (ckpts[0] / "train_state.pt").write_bytes(b"optimizer state that must not be registered")
    plot = tmp / "reliability.png"
    plot.write_bytes(b"\x89PNG fake")
    uri = f"sqlite:///{tmp}/mlflow.db"
    reg = DrafterRegistry(uri, artifact_location=str(tmp / "mlartifacts"))
    cal = CAL | {"target_fingerprint": target.fingerprint}
    versions = [reg.register("code", ck, params={"steps": 150, "lr": 3e-4}, metrics=metrics(tau), calibration=cal,
                             sps=SPS, plots=[plot], tags={"trace_window": "2025-01-01/2025-01-08"},
                             idempotency_key=f"retrain-{i}")
                for i, (ck, tau) in enumerate(zip(ckpts, (2.0, 2.5)))]
    return {"tmp": tmp, "uri": uri, "reg": reg, "target": target, "ckpts": ckpts, "versions": versions, "cal": cal}


def test_two_versions_with_challenger_tags_params_and_metrics(env):
    reg, v1, v2 = env["reg"], *env["versions"]
    assert (v1.version, v2.version) == (1, 2) and v2.name == model_name("code") == "dspark-drafter-code"
    assert v2.model_uri == "models:/dspark-drafter-code/2"
    assert [v.version for v in reg.versions("code")] == [1, 2] and reg.domains() == ["code"]
    assert reg.get_alias("code", "challenger") == v2 and reg.champion("code") is None
    info = reg.version_info("code", 2)
    assert info.aliases == ["challenger"] and info.run_id == v2.run_id and info.model_uri == v2.model_uri
    assert info.domain == "code" and info.target_fingerprint == env["target"].fingerprint
    assert ModelVersionInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info    # `registry show --json`
    tags = info.tags
    assert tags["target_fingerprint"] == env["target"].fingerprint and tags["domain"] == "code"
    assert tags["code_version"].startswith("0.") and tags["run_key"] == "retrain-1"
    assert tags["trace_window"] == "2025-01-01/2025-01-08" and tags["trace_count"] == "120"
    m = info.metrics
    assert m["tau"] == 2.5 and m["speedup"] == 1.7 and m["lossless_failures"] == 0
    assert m["acceptance_per_position"] == [0.9, 0.7, 0.5] and m["ece_calibrated"] == [0.01, 0.02, 0.015]
    assert info.params["steps"] == "150" and info.params["drafter.kind"] == "dspark"
    run_files = [a.path for a in reg.client.list_artifacts(v2.run_id, "plots")]
    assert run_files == ["plots/reliability.png"]
    assert not (env["tmp"].parent / "mlruns").exists() and not os.path.exists("mlruns")


def test_pyfunc_loads_by_alias_and_answers_lookups(env, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["uri"])
    model = mlflow.pyfunc.load_model("models:/dspark-drafter-code@challenger")
    fp, cal, sps, cfg = model.predict(["target_fingerprint", "calibration", "sps", "config"])
    assert json.loads(fp) == env["target"].fingerprint
    assert json.loads(cal) == env["cal"] and json.loads(sps) == SPS
    assert json.loads(cfg)["config"]["kind"] == "dspark"
    with pytest.raises(Exception, match="unknown drafter keys"):
        model.predict(["weights"])


def test_drafter_from_registry_drafts_like_the_original_checkpoint(env):
    target = env["target"]
    r, fp = target.runner, target.fingerprint
    drafter = load_drafter_from_registry("models:/dspark-drafter-code@challenger", r, fp, tracking_uri=env["uri"])
    original = build_proposer("dspark", r, fp, env["ckpts"][1])
    for k, v in original.drafter.state_dict().items():
        assert torch.equal(drafter.state_dict()[k], v), k
    loaded = BlockProposer(drafter, fp)
    out = r.forward(r.new_cache(1, 64), torch.tensor([[3, 4, 5, 6]]), taps=loaded.tap_layers)
    params = SamplingParams()
    da = loaded.propose(loaded.start([3, 4, 5, 6], out.taps[0]), 9, 4, params, None)
    db = original.propose(original.start([3, 4, 5, 6], out.taps[0]), 9, 4, params, None)
    assert da.tokens.tolist() == db.tokens.tolist()
    assert mlflow.get_tracking_uri() != env["uri"]        # the adapter restored the caller's URI
    other = tiny_target("llama", vocab=64, seed=3)
    with pytest.raises(DrafterMismatchError, match="trained for target"):
        load_drafter_from_registry("models:/dspark-drafter-code/2", other.runner, other.fingerprint,
                                   tracking_uri=env["uri"])


def test_download_gives_checkpoint_calibration_and_sps(env, tmp_path):
    dst = env["reg"].download("code", "challenger", tmp_path / "serving" / "code")
    assert sorted(p.name for p in (dst / "checkpoint").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((dst / "calibration.json").read_text()) == env["cal"]
    assert json.loads((dst / "sps.json").read_text()) == SPS
    assert json.loads((dst / "registry.json").read_text())["version"] == 2
    assert env["reg"].download("code", 1, dst) == dst                 # replaces the folder whole
    assert json.loads((dst / "registry.json").read_text())["version"] == 1
    with pytest.raises(RegistryError, match="no alias 'nope'"):
        env["reg"].download("code", "nope", tmp_path / "x")


def test_promote_and_rollback_move_champion(env):
    reg = env["reg"]
    first = reg.promote("code", 1, reason="first champion")
    assert first.previous_champion is None and reg.champion("code").version == 1
    second = reg.promote("code", 2, reason="gate passed")
    assert second.previous_champion == 1 and reg.champion("code").version == 2
    assert reg.promote("code", 2, reason="again") == second          # already champion: nothing changes
    tags = reg.version_info("code", 2).tags
    assert tags["previous_champion"] == "1" and tags["promoted_at"] == second.promoted_at
    assert reg.version_info("code", 2).aliases == ["challenger", "champion"]
    assert reg.champion_info("code") == reg.version_info("code", 2) and reg.champion_info("math") is None
    assert reg.rollback("code", reason="live acceptance dropped") == 1 and reg.champion("code").version == 1
    assert "rolled_back_at" in reg.version_info("code", 2).tags
    with pytest.raises(RegistryError, match="no previous champion"):
        reg.rollback("code")
    with pytest.raises(RegistryError, match="only through promote"):
        reg.set_alias("code", "champion", 2)
    assert reg.set_alias("code", "canary", 2).version == 2 and reg.get_alias("code", "canary").version == 2
    assert reg.get_alias("math", "champion") is None and reg.get_alias("code", "missing") is None


def test_register_with_a_known_idempotency_key_returns_the_existing_version(env):
    reg, v1, v2 = env["reg"], *env["versions"]
    again = reg.register("code", env["ckpts"][0], params={}, metrics={"tau": 9.0}, calibration=None, sps=None,
                         plots=[], tags={}, idempotency_key="retrain-0")
    assert again == v1 and [v.version for v in reg.versions("code")] == [1, 2]
    assert reg.get_alias("code", "challenger") == v2                  # not the newest: alias untouched
    reg.set_alias("code", "challenger", 1)                            # as if a crash came before the alias
    assert reg.register("code", env["ckpts"][1], params={}, metrics={}, idempotency_key="retrain-1") == v2
    assert reg.get_alias("code", "challenger") == v2                  # the newest version: alias repaired
    assert reg.find_version("code", "run_key", "retrain-1") == v2
    assert reg.find_version("code", "run_key", "never") is None


def test_checkpoint_without_target_fingerprint_is_refused(env, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in ("model.safetensors", "config.json"):
        (ck / f).write_bytes((env["ckpts"][0] / f).read_bytes())
    meta = json.loads((ck / "config.json").read_text())
    reg, kw = env["reg"], dict(params={}, metrics={"tau": 2.0}, calibration=None, sps=None, plots=[], tags={})
    with pytest.raises(RegistryError, match="calibration .* differs"):
        reg.register("code", ck, **kw | {"calibration": CAL | {"target_fingerprint": "other"}})
    del meta["target_fingerprint"]
    (ck / "config.json").write_text(json.dumps(meta))
    with pytest.raises(RegistryError, match="has no target_fingerprint"):
        reg.register("code", ck, **kw)
    with pytest.raises(RegistryError, match="metric 'tau' must be a number"):
        reg.register("code", env["ckpts"][0], **kw | {"metrics": {"tau": "high"}})
    with pytest.raises(RegistryError, match="invalid domain"):
        reg.register("Code Review", env["ckpts"][0], **kw)
    assert [v.version for v in reg.versions("code")] == [1, 2]


def test_sqlite_store_keeps_artifacts_next_to_the_database(tmp_path):
    assert DrafterRegistry(f"sqlite:///{tmp_path}/m.db").artifact_location == str(tmp_path / "mlartifacts")
    assert not (tmp_path / "m.db").exists()                           # the store opens on first use


CHAMP = {"tau": 2.0, "ece_calibrated": [0.01, 0.02]}


@pytest.mark.parametrize("challenger, champion, promote, why", [
    ({"tau": 1.0, "ece_calibrated": 0.2}, None, True, "no champion yet"),
    ({"tau": 2.1, "ece_calibrated": [0.01, 0.025]}, CHAMP, True, "tau 2.100 >= 2.040"),
    ({"tau": 2.03, "ece_calibrated": [0.01, 0.02]}, CHAMP, False, "tau 2.030 < 2.040"),
    ({"tau": 2.5, "ece_calibrated": [0.01, 0.05]}, CHAMP, False, "0.0500 > bound 0.0300"),
    ({"tau": 2.5, "ece_calibrated": 0.05}, {"tau": 2.0, "ece_calibrated": 0.06}, True, "0.0500 <= bound 0.0600"),
    ({"tau": 2.5}, CHAMP, False, "no calibrated ECE"),
    ({"tau": 2.5, "ece_calibrated": 0.0, "lossless_failures": 1}, None, False, "lossless check failed"),
    ({"tau": 2.1, "ece_calibrated": 0.01, "tau_vs_champion": 1.05, "tau_vs_champion_low": 0.99,
      "tau_vs_champion_high": 1.11}, CHAMP, True, "tau / champion 1.050, 5-95 % 0.990-1.110 over paired"),
])
def test_gate(challenger, champion, promote, why):
    d = gate(challenger, champion)
    assert isinstance(d, GateDecision) and d.promote is promote
    assert any(why in r for r in d.reasons), d.reasons


def test_artifacts_are_checked_against_their_registered_digests(env, tmp_path):
    from registry.mlflow_registry import INTEGRITY_TAG, ArtifactIntegrityError
    target = env["target"]
    reg = DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db", artifact_location=str(tmp_path / "mlartifacts"))
    v = reg.register("chat", env["ckpts"][0], params={}, metrics={"tau": 1.0}, calibration=env["cal"], sps=SPS)
    digests = json.loads(reg.version_info("chat", v.version).tags[INTEGRITY_TAG])
    assert {"checkpoint/model.safetensors", "checkpoint/config.json", "calibration.json", "sps.json"} <= set(digests)
    dst = reg.download("chat", v.version, tmp_path / "ok")
    assert reg.verify("chat", v.version, dst) is True
    # a changed file in the artifact store is refused by every loader
    stored = next((tmp_path / "mlartifacts").rglob("artifacts/checkpoint/model.safetensors"))
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match="checkpoint/model.safetensors differs"):
        reg.download("chat", v.version, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ArtifactIntegrityError):
        load_drafter_from_registry("models:/dspark-drafter-chat/1", target.runner, target.fingerprint,
                                   tracking_uri=reg.tracking_uri)
    (dst / "sps.json").write_text("{}")                      # a tampered local cache is caught at load too
    with pytest.raises(ArtifactIntegrityError, match="sps.json"):
        reg.verify("chat", v.version, dst)
    with pytest.raises(RegistryError, match="not a drafter model URI"):
        load_drafter_from_registry("runs:/abc/drafter", target.runner, target.fingerprint, tracking_uri=reg.tracking_uri)
