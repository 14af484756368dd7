"""Kill-and-resume: ``dspark flow run retrain`` is SIGKILLed in a subprocess while it trains a domain, then
run again. Finished steps come back from Prefect's persisted cache (the journal shows they did not run
again), the interrupted training resumes from its last checkpoint, and the store holds one version and
no duplicate rows."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import make_home
from helpers import flow_env, journal_steps, landing_lines

from registry.mlflow_registry import DrafterRegistry
from registry.warehouse import TraceWarehouse

REPO = Path(__file__).resolve().parents[2]
ARGS = ["flow", "run", "retrain", "--domains", "code", "--budget", "tiny", "--set", "steps=600",
        "--set", "checkpoint_every=20", "--max-ece", "1.0", "--json"]


def _env(home: Path) -> dict:
    from prefect.settings import PREFECT_API_URL
    env = {**os.environ, **flow_env(home), "OMP_NUM_THREADS": "1"}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()           # the session's harness server
    env.pop("PREFECT_RESULTS_LOCAL_STORAGE_PATH", None)          # the CLI's default: under DSPARK_HOME
    return env


def _dspark(home: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dspark_core.cli", *ARGS], cwd=REPO, env=_env(home),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _checkpointed_step(home: Path) -> int:
    for cfg in (home / "flows" / "drafters" / "code").glob("*/config.json"):
        if (cfg.parent / "train_state.pt").exists():
            return int(json.loads(cfg.read_text()).get("step", 0))
    return 0


def test_sigkilled_retrain_resumes_without_redoing_finished_steps(tmp_path, tiny_model_dir, tiny_records):
    home = make_home(tmp_path / "home", tiny_model_dir, tiny_records[1])
    proc = _dspark(home)
    deadline = time.monotonic() + 300
    while _checkpointed_step(home) < 20 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is not None:
        pytest.fail("the flow ended before it could be killed:\n" + proc.stdout.read().decode()[-3000:])
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    killed_at = _checkpointed_step(home)
    assert 20 <= killed_at < 600
    starts = journal_steps(home)
    assert starts.count("train-generic") == 1 and starts.count("train-code") == 1
    assert "train-code" not in journal_steps(home, "done")

    proc = _dspark(home)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out.decode()[-3000:]
    starts = journal_steps(home)
    assert starts.count("train-generic") == 1                       # finished before the kill: cached
    assert starts.count("train-code") == 2                          # interrupted: run again...
    done = [json.loads(x) for x in (home / "flows" / "journal.jsonl").read_text().splitlines()
            if '"train-code"' in x and '"done"' in x]
    assert len(done) == 1 and done[0]["resumed_from"] >= killed_at  # ...from its last checkpoint
    reg = DrafterRegistry(f"sqlite:///{home / 'mlflow.db'}")
    assert [v.version for v in reg.versions("code")] == [1] and reg.champion("code").version == 1
    with TraceWarehouse(home / "traces.duckdb", read_only=True) as wh:
        assert wh.count() == landing_lines(home) == 48

    proc = _dspark(home)                                            # a third run over the same traces
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out.decode()[-3000:]
    assert journal_steps(home) == starts and [v.version for v in reg.versions("code")] == [1]
