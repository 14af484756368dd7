"""The retrain flow on the real SmolLM2 target, kept small: a few bootstrap prompts of one domain, ingest,
a handful of training steps, calibration, evaluation, lossless check, registration and promotion."""

import pytest

from helpers import setenv

pytestmark = pytest.mark.real


def test_retrain_one_domain_on_smollm2(smollm2, dspark_home, tmp_path, monkeypatch):
    from dspark_core.data.bootstrap import BootstrapConfig, bootstrap_traces
    from dspark_core.model.target import DEFAULT_TARGET
    from flows.retrain import retrain
    from registry.mlflow_registry import DrafterRegistry
    home = tmp_path / "home"
    (home / "targets").mkdir(parents=True)
    (home / "targets" / DEFAULT_TARGET).symlink_to(dspark_home / "targets" / DEFAULT_TARGET)
    bootstrap_traces(smollm2, home, BootstrapConfig(("math",), per_domain=6, max_new_tokens=24, heldout_fraction=0.34),
                     progress=False)
    setenv(monkeypatch, {"DSPARK_HOME": str(home), "DSPARK_TARGET": DEFAULT_TARGET, "DSPARK_FLOW_DTYPE": "float32"})
    small = {"generic_steps": 3, "steps": 2, "draft_vocab": 2048, "preset": "tiny", "eval_prompts": 1,
             "eval_max_new_tokens": 12, "lossless_prompts": 1, "lossless_max_new_tokens": 12, "calib_prompts": 1,
             "calib_max_new_tokens": 16, "min_rounds": 5, "sps_max_tokens": 2, "sps_reps": 1, "sps_context": 16}
    out = retrain(domains=["math"], budget="quick", budget_overrides=small, max_ece=1.0)
    res = out.results["math"]
    assert res.decision == "promoted" and res.after["lossless_failures"] == 0
    reg = DrafterRegistry(f"sqlite:///{home / 'mlflow.db'}")
    info = reg.champion_info("math")
    assert info.target_fingerprint == smollm2.fingerprint and info.metrics["tau"] >= 1.0
    assert out.ingest.trace_rows == 6

    # the champion leaves the registry in vLLM's format: registered with it, handed out by the CLI
    import json

    from dspark_core.cli.main import main
    from speculators import SpeculatorModel
    fleet = tmp_path / "fleet"
    assert main(["registry", "export", "math", "--format", "speculators", "--out", str(fleet), "--json"]) == 0
    config = json.loads((fleet / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["dspark"]["target_fingerprint"] == smollm2.fingerprint
    _, loaded = SpeculatorModel.from_pretrained(str(fleet), output_loading_info=True)
    assert not loaded["unexpected_keys"]
    assert main(["registry", "export", "math", "--format", "deepspec", "--out", str(tmp_path / "ds"), "--json"]) == 0
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
