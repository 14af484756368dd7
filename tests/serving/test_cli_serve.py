"""``dspark serve`` as a user starts it: a subprocess with a local tiny checkpoint (``--model``), a sqlite
MLflow registry from the environment and ``DSPARK_ADMIN_TOKEN``; the real ``openai`` client, the metrics
endpoint and an admin reload from the registry, all over loopback."""

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dspark_core.drafters import save_drafter
from serving_helpers import char_tokenizer, peaky_dspark
from tiny_models import tiny_hf_model

TOKEN = "cli-test-token"


@pytest.fixture
def home(tmp_path, monkeypatch):
    from dspark_core.model.target import load_target, prepare_local
    from registry.mlflow_registry import DrafterRegistry
    model_dir = tmp_path / "tiny-model"
    tiny_hf_model("llama", vocab=64, seed=5).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    home = tmp_path / "home"
    target = load_target(prepare_local(model_dir, home, log=lambda *_: None))
    reg = DrafterRegistry(f"sqlite:///{home}/mlflow.db", str(home / "mlartifacts"))
    for seed in (1, 2):
        ck = save_drafter(peaky_dspark(target, seed).drafter, tmp_path / f"ck{seed}", target.fingerprint)
        reg.register("code", ck, params={}, metrics={"tau": 1.0})
    reg.promote("code", 1, "test")
    return {"home": home, "model": model_dir, "registry": reg}


def test_dspark_serve_cli_end_to_end(home, tmp_path):
    port = _free_port()
    env = {**os.environ, "DSPARK_HOME": str(home["home"]), "DSPARK_ADMIN_TOKEN": TOKEN,
           "MLFLOW_DISABLE_TELEMETRY": "true", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dspark_core.cli", "serve", "--model", str(home["model"]), "--port", str(port),
           "--policy", "fixed", "--domains", "code,chat", "--poll-interval", "0", "--log-level", "warning"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, tmp_path / "serve.log")
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        r = c.completions.create(model=f"{model}:code", prompt="def f(x):", max_tokens=12, temperature=0)
        assert r.model_extra["dspark"]["drafter"] == "dspark-code:v1" and r.usage.completion_tokens >= 1
        chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True, seed=3))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(url + "/admin/drafters").status_code == 401
        home["registry"].promote("code", 2, "cli test")
        r = httpx.post(url + "/admin/drafters/code/reload", json={"alias": "champion"}, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
        again = c.completions.create(model=model, prompt="def f(x):", max_tokens=12, temperature=0,
                                     extra_body={"domain": "code"})
        assert again.model_extra["dspark"]["drafter"] == "dspark-code:v2"
        metrics = httpx.get(url + "/metrics").text
        assert 'dspark:drafter_active_version{domain="code"} 2.0' in metrics
        assert 'dspark:drafter_swaps_total{domain="code",reason="admin"} 1.0' in metrics
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert proc.returncode in (0, -15), (tmp_path / "serve.log").read_text()[-3000:]
    audit = (home["home"] / "serving" / "audit.jsonl").read_text()
    assert '"action": "reload"' in audit and '"outcome": "swapped"' in audit
    assert list((home["home"] / "landing").glob("*/serving-*.jsonl"))


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc, url, log_path, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"dspark serve exited: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("dspark serve did not start")
