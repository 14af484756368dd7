"""Prefect tasks: each wraps one call into ``dspark_core.pipeline.steps`` or a ``registry`` adapter.

Retries only on I/O (warehouse, registry, artifact downloads, the serving call). Compute steps
(training, calibration, evaluation, the lossless check, SPS profiling) are cached by a deterministic
key passed in as ``key`` and persisted as JSON in Prefect's result storage, so a rerun after a crash
(even SIGKILL) gets them back as ``Cached`` instead of running them again. A step that was killed
halfway is redone, and training then resumes from its last checkpoint (bit-exact). Each step that
really runs writes ``start``/``done`` lines to the journal (:mod:`flows.journal`).

Task results are small dicts of numbers, lists and paths; the target model never travels through
Prefect: it is loaded once per process and kept in :data:`_TARGETS`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from dspark_core.pipeline import steps as pipeline
from dspark_core.pipeline.steps import Budget

from . import journal
from .handoff import notify_reload

_TARGETS: dict[tuple[str, str], object] = {}
_TARGET_LOCK = threading.Lock()


def _cache_key(context, parameters) -> str:
    """The step's content key, scoped to the pipeline's work folder: two DSPARK_HOMEs sharing one Prefect
    result store never answer each other's steps."""
    where = parameters.get("workdir") or parameters.get("dst") or parameters.get("tracking_uri", "")
    scope = pipeline.stable_key([where, parameters.get("tracking_uri", "")], 8)
    return f"dspark-{context.task.name}-{scope}-{parameters['key']}"


CACHED = dict(cache_key_fn=_cache_key, persist_result=True, result_serializer="json")
IO = dict(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)


def load_target(spec: str, home: str, dtype: str):
    """The prepared target ``spec`` (name under ``home/targets`` or a folder) in ``dtype`` on the flows'
    device (``DSPARK_FLOW_DEVICE``), loaded once per process."""
    from dspark_core.engine.inputs import resolve_dtype
    from dspark_core.model.target import load_target as load, resolve_target_dir
    from .settings import FlowSettings
    device = FlowSettings.from_env().device
    folder = resolve_target_dir(spec, Path(home))
    torch_dtype = resolve_dtype(dtype, device)
    key = (str(folder.resolve()), str(torch_dtype), device)
    with _TARGET_LOCK:
        if key not in _TARGETS:
            _TARGETS[key] = load(folder, dtype=torch_dtype, device=device)
        return _TARGETS[key]


class _Step:
    """Journal a step's start and end (with a summary of its result)."""

    def __init__(self, workdir: str, step: str, key: str, **extra):
        self.workdir, self.step, self.key, self.extra = Path(workdir), step, key, extra

    def __enter__(self):
        journal.record(self.workdir, self.step, self.key, "start", **self.extra)
        return self

    def done(self, result, **extra):
        journal.record(self.workdir, self.step, self.key, "done", **extra)
        return result

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------------- warehouse
@task(name="ingest-landing", **IO)
def ingest_landing(warehouse: str, landing: str) -> dict:
    from registry.warehouse import TraceWarehouse
    with TraceWarehouse(Path(warehouse)) as wh:
        summary = wh.ingest_landing(Path(landing)).to_dict()
        return {**summary, **{f"total_{k}": v for k, v in wh.totals().items()}, "trace_rows": wh.count(),
                "domains": wh.domains()}


@task(name="snapshot-traces", task_run_name="snapshot-{domain}", **IO)
def snapshot(warehouse: str, home: str, domain: str, target_fingerprint: str, out_root: str) -> dict:
    from registry.datasets import snapshot_splits
    return snapshot_splits(warehouse, home, domain, target_fingerprint, out_root)


@task(name="live-acceptance", task_run_name="live-acceptance-{domain}", **IO)
def live_acceptance(warehouse: str, domain: str, since: str) -> dict:
    from registry.warehouse import TraceWarehouse
    with TraceWarehouse(Path(warehouse), read_only=True) as wh:
        return wh.live_acceptance(domain, since=since)


# -------------------------------------------------------------------------------------- registry
def _registry(tracking_uri: str, artifact_location: str):
    from registry.mlflow_registry import DrafterRegistry
    return DrafterRegistry(tracking_uri, artifact_location)


@task(name="champion", task_run_name="champion-{domain}", **IO)
def champion(tracking_uri: str, artifact_location: str, domain: str) -> dict | None:
    """The domain's champion: version, tags and metrics (None when there is none)."""
    reg = _registry(tracking_uri, artifact_location)
    found = reg.champion(domain)
    if found is None:
        return None
    info = reg.version_info(domain, found.version)
    return {"version": found.version, "tags": info["tags"], "metrics": info["metrics"]}


@task(name="plan-warm-start", task_run_name="plan-{domain}", retries=2, retry_delay_seconds=2, **CACHED)
def plan(tracking_uri: str, artifact_location: str, domain: str, target_fingerprint: str, key: str) -> dict:
    """The warm start of one domain's training, decided once per key (persisted): the domain's champion if
    it was registered for this target, else the generic drafter. A rerun over the same traces keeps the
    decision even after that run's challenger became champion, so it retrains nothing."""
    reg = _registry(tracking_uri, artifact_location)
    found = reg.champion(domain)
    if found is not None:
        tags = reg.version_info(domain, found.version)["tags"]
        if tags.get("target_fingerprint") == target_fingerprint:
            return {"init": "champion", "version": found.version}
    return {"init": "generic"}


@task(name="find-registered", task_run_name="find-registered-{domain}", **IO)
def find_registered(tracking_uri: str, artifact_location: str, domain: str, idempotency_key: str) -> dict | None:
    """The version registered under ``idempotency_key`` (number, aliases, metrics), or None."""
    reg = _registry(tracking_uri, artifact_location)
    found = reg.find_version(domain, "run_key", idempotency_key)
    if found is None:
        return None
    info = reg.version_info(domain, found.version)
    return {"version": found.version, "model_uri": found.model_uri, "aliases": info["aliases"],
            "metrics": info["metrics"]}


@task(name="download-drafter", task_run_name="download-{domain}-v{version}", retries=2, retry_delay_seconds=2,
      **CACHED)
def download(tracking_uri: str, artifact_location: str, domain: str, version: int, dst: str, key: str) -> str:
    """A registered version's checkpoint folder, fetched once into ``dst``."""
    out = _registry(tracking_uri, artifact_location).download(domain, version, Path(dst))
    return str(out / "checkpoint")


@task(name="register-drafter", task_run_name="register-{domain}", **IO)
def register(tracking_uri: str, artifact_location: str, domain: str, checkpoint: str, params: dict, metrics: dict,
             calibration_path: str | None, sps_path: str | None, plots: list[str], tags: dict,
             idempotency_key: str) -> dict:
    reg = _registry(tracking_uri, artifact_location)
    read = (lambda p: json.loads(Path(p).read_text()) if p else None)
    rv = reg.register(domain, Path(checkpoint), params=params, metrics=metrics, calibration=read(calibration_path),
                      sps=read(sps_path), plots=[Path(p) for p in plots if Path(p).exists()], tags=tags,
                      idempotency_key=idempotency_key)
    return asdict(rv)


@task(name="gate", task_run_name="gate-{domain}", cache_policy=NO_CACHE)
def gate(domain: str, challenger_metrics: dict, champion_metrics: dict | None, min_tau_gain: float,
         max_ece: float) -> dict:
    from registry.mlflow_registry import gate as decide
    return asdict(decide(challenger_metrics, champion_metrics, min_tau_gain, max_ece, first_needs_ece=True))


@task(name="promote", task_run_name="promote-{domain}-v{version}", **IO)
def promote(tracking_uri: str, artifact_location: str, domain: str, version: int, reason: str) -> dict:
    return asdict(_registry(tracking_uri, artifact_location).promote(domain, version, reason))


@task(name="serving-reload", task_run_name="serving-reload-{domain}", cache_policy=NO_CACHE)
def serving_reload(server_url: str, domain: str, token: str | None) -> dict:
    """Never fails the flow: a failed call is a warning (serving also polls the aliases)."""
    res = notify_reload(server_url, domain, token)
    log = get_run_logger()
    if res["ok"]:
        log.info(f"serving reloaded {domain}: {res['url']} -> {res['status']}")
    else:
        log.warning(f"serving reload of {domain} failed ({res.get('error') or res.get('status')}); serving will "
                    f"pick up the new champion when it next polls the registry aliases")
    return res


# --------------------------------------------------------------------------------------- compute
@task(name="train-drafter", task_run_name="train-{domain}", **CACHED)
def train(target: str, home: str, dtype: str, workdir: str, domain: str, snapshots: list[str], out_dir: str,
          init: str | None, budget: dict, steps: int, key: str) -> dict:
    tgt = load_target(target, home, dtype)
    with _Step(workdir, f"train-{domain}", key) as step:
        res = pipeline.train_with_budget(tgt, pipeline.examples_from_snapshots(snapshots), Path(out_dir),
                                         Budget(**budget), steps, Path(init) if init else None,
                                         extra_meta={"domain": domain}, home=Path(home))
        return step.done(res, resumed_from=res["resumed_from"], steps=res["steps"])


@task(name="calibrate-drafter", task_run_name="calibrate-{domain}", **CACHED)
def calibrate(target: str, home: str, dtype: str, workdir: str, domain: str, checkpoint: str, heldout: str,
              budget: dict, key: str) -> dict:
    tgt, b = load_target(target, home, dtype), Budget(**budget)
    with _Step(workdir, f"calibrate-{domain}", key) as step:
        prompts = pipeline.heldout_prompts(pipeline.read_records(Path(heldout)), b.calib_prompts)
        res = pipeline.calibrate_drafter(tgt, Path(checkpoint), prompts, Path(checkpoint) / f"calibration-{domain}.json",
                                         b.calib_max_new_tokens, b.calib_temperature, b.min_rounds, b.seed)
        return step.done(res, rounds=res["rounds"])


@task(name="profile-sps", task_run_name="profile-sps-{domain}", **CACHED)
def profile(target: str, home: str, dtype: str, workdir: str, domain: str, checkpoint: str, budget: dict,
            key: str) -> dict:
    tgt, b = load_target(target, home, dtype), Budget(**budget)
    with _Step(workdir, f"profile-sps-{domain}", key) as step:
        res = pipeline.profile_drafter(tgt, Path(checkpoint), Path(checkpoint) / "sps.json", b.sps_max_tokens,
                                       b.sps_reps, b.sps_context)
        return step.done(res)


@task(name="evaluate-drafter", task_run_name="evaluate-{domain}", **CACHED)
def evaluate(target: str, home: str, dtype: str, workdir: str, domain: str, checkpoint: str, heldout: str,
             baseline: str | None, budget: dict, key: str) -> dict:
    tgt, b = load_target(target, home, dtype), Budget(**budget)
    with _Step(workdir, f"evaluate-{domain}", key) as step:
        prompts = pipeline.heldout_prompts(pipeline.read_records(Path(heldout)), b.eval_prompts)
        res = pipeline.evaluate_drafter(tgt, Path(checkpoint), prompts, b.eval_max_new_tokens, 0.0,
                                        b.eval_block_size, b.seed, baseline=Path(baseline) if baseline else None,
                                        log=print)
        return step.done(res, tau=res["tau"])


@task(name="lossless-check", task_run_name="lossless-{domain}", **CACHED)
def lossless(target: str, home: str, workdir: str, domain: str, checkpoint: str, heldout: str, budget: dict,
             key: str) -> dict:
    """Always in float32, whatever the pipeline's dtype: there greedy speculation is exactly lossless."""
    tgt, b = load_target(target, home, "float32"), Budget(**budget)
    with _Step(workdir, f"lossless-{domain}", key) as step:
        prompts = pipeline.heldout_prompts(pipeline.read_records(Path(heldout)), b.lossless_prompts)
        res = pipeline.lossless_check(tgt, Path(checkpoint), prompts, b.lossless_max_new_tokens, b.eval_block_size)
        return step.done(res, failures=res["failures"])


@task(name="check-target", task_run_name="check-target-{domain}", cache_policy=NO_CACHE)
def check_target(domain: str, checkpoint: str, target_fingerprint: str) -> dict:
    return pipeline.check_drafter_target(Path(checkpoint), target_fingerprint)


@task(name="checkpoint-digest", cache_policy=NO_CACHE)
def digest(checkpoint: str) -> str:
    return pipeline.checkpoint_digest(Path(checkpoint))
