"""One Prefect test harness per session (its start-up is slow), with its own PREFECT_HOME and result
store in temporary folders, so no run here touches ~/.prefect or sees another session's cache."""

import os
import sys
import tempfile
from pathlib import Path

# Prefect and MLflow read these on import: set them before any test module imports flows/registry.
_PREFECT_TMP = Path(tempfile.mkdtemp(prefix="dspark-prefect-tests-"))
os.environ["PREFECT_HOME"] = str(_PREFECT_TMP / "home")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def prefect_backend():
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness
    with temporary_settings(updates={PREFECT_RESULTS_LOCAL_STORAGE_PATH: str(_PREFECT_TMP / "results")}):
        with prefect_test_harness(server_startup_timeout=90):
            yield _PREFECT_TMP


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from helpers import save_tiny_target
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def tiny_records(tiny_model_dir, tmp_path_factory):
    """Bootstrap-like traces of the tiny target for two domains (24 prompts each), made once."""
    from dspark_core.model.target import load_target, prepare_local
    from helpers import DOMAINS, make_records
    home = tmp_path_factory.mktemp("records-home")
    target = load_target(prepare_local(tiny_model_dir, home, name="tiny", log=lambda _: None))
    recs = [r for i, d in enumerate(DOMAINS) for r in make_records(target.runner, target.fingerprint, d, 24, seed=i)]
    return target, recs
