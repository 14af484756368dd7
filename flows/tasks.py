"""Prefect tasks: each wraps one call into ``dspark_core.pipeline.steps`` or a ``registry`` adapter.

Retries only on I/O (warehouse, registry, artifact downloads, the serving call). Compute steps
(training, calibration, evaluation, the lossless check, SPS profiling) and the warm-start plan are cached
by a deterministic key passed in as ``key`` and persisted as JSON in Prefect's result store, so a rerun
after a crash (even SIGKILL) gets them back as ``Cached`` instead of running them again. A step that was
killed halfway is redone, and training then resumes from its last checkpoint (bit-exact). Each step that
really runs writes ``start``/``done`` lines to the journal (:mod:`flows.journal`).

Every task hands back a dataclass. A cached one is a private ``@task`` that returns its result's
``to_dict()`` (plain JSON, which is what gets persisted) and a public function of the same name without
the underscore that reads it back with ``from_dict()``. A result persisted by an earlier version with the
same keys therefore still resumes a run. The target model never travels through Prefect: it is loaded once
per process and kept in :data:`_TARGETS`.
"""

from __future__ import annotations

import json
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from dspark_core.engine.inputs import resolve_dtype
from dspark_core.formats import FormatError, export_drafter
from dspark_core.model.target import load_target as load, resolve_target_dir
from dspark_core.pipeline import steps as pipeline
from dspark_core.pipeline.steps import (Budget, CalibrationSummary, EvalSummary, LosslessSummary, ProfileSummary,
                                        TrainSummary)
from registry.datasets import Snapshot, snapshot_splits
from registry.mlflow_registry import (DrafterRegistry, GateDecision, ModelVersionInfo, PromotionRecord,
                                      RegisteredVersion, gate as decide)
from registry.warehouse import LandingIngest, LiveAcceptance, TraceWarehouse, target_vocab_sizes

from . import journal
from .handoff import LiveCalibrationState, ReloadResult, fetch_live_calibration, notify_reload
from .results import Challenger, WarmStart
from .settings import FlowSettings

_TARGETS: dict[tuple[str, str], object] = {}
_TARGET_LOCK = threading.Lock()


@dataclass(frozen=True)
class StepContext:
    """What every compute step needs besides its own inputs: the target (prepared name or folder, the
    home it is prepared under, the dtype to load it in) and the flows' work folder (journal, outputs)."""

    target: str
    home: str
    dtype: str
    workdir: str


def _cache_key(context, parameters) -> str:
    """The step's content key, scoped to the pipeline's work folder: two DSPARK_HOMEs sharing one Prefect
    result store never answer each other's steps."""
    ctx = parameters.get("ctx")
    where = (ctx.workdir if ctx is not None else None) or parameters.get("dst") or parameters.get("tracking_uri", "")
    scope = pipeline.stable_key([where, parameters.get("tracking_uri", "")], 8)
    return f"dspark-{context.task.name}-{scope}-{parameters['key']}"


CACHED = dict(cache_key_fn=_cache_key, persist_result=True, result_serializer="json")
IO = dict(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)


def load_target(spec: str, home: str, dtype: str):
    """The prepared target ``spec`` (name under ``home/targets`` or a folder) in ``dtype`` on the flows'
    device (``DSPARK_FLOW_DEVICE``), loaded once per process."""
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
def ingest_landing(warehouse: str, landing: str, targets: str | None = None) -> LandingIngest:
    """Ingest the landing folder; with ``targets`` (``<home>/targets``), token ids outside a known target's
    vocabulary are quarantined with their reason."""
    with TraceWarehouse(Path(warehouse), vocab_sizes=target_vocab_sizes(targets) if targets else None) as wh:
        summary = wh.ingest_landing(Path(landing))
        return LandingIngest.of(summary, wh.totals(), wh.domains())


@task(name="snapshot-traces", task_run_name="snapshot-{domain}", **IO)
def snapshot(warehouse: str, home: str, domain: str, target_fingerprint: str, out_root: str) -> Snapshot:
    return snapshot_splits(warehouse, home, domain, target_fingerprint, out_root)


@task(name="live-acceptance", task_run_name="live-acceptance-{domain}", **IO)
def live_acceptance(warehouse: str, domain: str, since: str) -> LiveAcceptance:
    with TraceWarehouse(Path(warehouse), read_only=True) as wh:
        return wh.live_acceptance(domain, since=since)


# -------------------------------------------------------------------------------------- registry
def _registry(tracking_uri: str, artifact_location: str) -> DrafterRegistry:
    return DrafterRegistry(tracking_uri, artifact_location)


@task(name="champion", task_run_name="champion-{domain}", **IO)
def champion(tracking_uri: str, artifact_location: str, domain: str) -> ModelVersionInfo | None:
    """The domain's champion (None when there is none)."""
    return _registry(tracking_uri, artifact_location).champion_info(domain)


@task(name="plan-warm-start", task_run_name="plan-{domain}", retries=2, retry_delay_seconds=2, **CACHED)
def _plan(tracking_uri: str, artifact_location: str, domain: str, target_fingerprint: str, key: str) -> dict:
    champ = _registry(tracking_uri, artifact_location).champion_info(domain)
    if champ is not None and champ.target_fingerprint == target_fingerprint:
        return WarmStart("champion", champ.version).to_dict()
    return WarmStart("generic").to_dict()


def plan(tracking_uri: str, artifact_location: str, domain: str, target_fingerprint: str, key: str) -> WarmStart:
    """The warm start of one domain's training, decided once per key (persisted): the domain's champion if
    it was registered for this target, else the generic drafter. A rerun over the same traces keeps the
    decision even after that run's challenger became champion, so it retrains nothing."""
    return WarmStart.from_dict(_plan(tracking_uri, artifact_location, domain, target_fingerprint, key))


@task(name="find-registered", task_run_name="find-registered-{domain}", **IO)
def find_registered(tracking_uri: str, artifact_location: str, domain: str,
                    idempotency_key: str) -> ModelVersionInfo | None:
    """The version registered under ``idempotency_key``, or None."""
    reg = _registry(tracking_uri, artifact_location)
    found = reg.find_version(domain, "run_key", idempotency_key)
    return None if found is None else reg.version_info(domain, found.version)


@task(name="download-drafter", task_run_name="download-{domain}-v{version}", retries=2, retry_delay_seconds=2,
      **CACHED)
def download(tracking_uri: str, artifact_location: str, domain: str, version: int, dst: str, key: str) -> str:
    """A registered version's checkpoint folder, fetched once into ``dst``."""
    out = _registry(tracking_uri, artifact_location).download(domain, version, Path(dst))
    return str(out / "checkpoint")


def speculators_export(ctx: StepContext, checkpoint: str, out: Path) -> dict[str, Path]:
    """The checkpoint exported for vLLM (speculators format) into ``out``, as register's ``exports``; empty,
    with a warning, for a drafter outside the reference layout (one trained before it)."""
    target = load_target(ctx.target, ctx.home, "float32")        # the head rows exactly as the target has them
    try:
        return {"speculators": export_drafter(Path(checkpoint), target, "speculators", out)}
    except FormatError as e:
        get_run_logger().warning(f"registered without a speculators export: {e}")
        return {}


@task(name="register-drafter", task_run_name="register-{domain}", **IO)
def register(tracking_uri: str, artifact_location: str, domain: str, challenger: Challenger, params: dict,
             metrics: dict, tags: dict, idempotency_key: str, ctx: StepContext | None = None) -> RegisteredVersion:
    """Register the challenger's checkpoint with its calibration, SPS(B) profile, plots and (given the
    target's ``ctx``) its speculators export."""
    def read(path: str | None) -> dict | None:
        return json.loads(Path(path).read_text()) if path else None

    cal, sps = challenger.calibration, challenger.sps
    with tempfile.TemporaryDirectory(prefix="dspark-export-") as tmp:
        exports = speculators_export(ctx, challenger.checkpoint, Path(tmp) / "speculators") if ctx else {}
        return _registry(tracking_uri, artifact_location).register(
            domain, Path(challenger.checkpoint), params=params, metrics=metrics,
            calibration=read(cal.calibration if cal else None), sps=read(sps.sps if sps else None), exports=exports,
            plots=[Path(p) for p in challenger.plots if Path(p).exists()], tags=tags,
            idempotency_key=idempotency_key)


@task(name="gate", task_run_name="gate-{domain}", cache_policy=NO_CACHE)
def gate(domain: str, challenger_metrics: dict, champion_metrics: dict | None, min_tau_gain: float,
         max_ece: float) -> GateDecision:
    return decide(challenger_metrics, champion_metrics, min_tau_gain, max_ece, first_needs_ece=True)


@task(name="promote", task_run_name="promote-{domain}-v{version}", **IO)
def promote(tracking_uri: str, artifact_location: str, domain: str, version: int, reason: str) -> PromotionRecord:
    return _registry(tracking_uri, artifact_location).promote(domain, version, reason)


@task(name="serving-live-calibration", task_run_name="serving-live-calibration-{domain}", cache_policy=NO_CACHE)
def serving_live_calibration(server_url: str, domain: str, token: str | None) -> LiveCalibrationState:
    """Serving's live ECE for the drift check; a failed call is a warning and leaves live tau to decide."""
    res = fetch_live_calibration(server_url, domain, token)
    if res.error:
        get_run_logger().warning(f"could not read serving's live calibration of {domain}: {res.error}")
    return res


@task(name="serving-reload", task_run_name="serving-reload-{domain}", cache_policy=NO_CACHE)
def serving_reload(server_url: str, domain: str, token: str | None) -> ReloadResult:
    """Never fails the flow: a failed call is a warning (serving also polls the aliases)."""
    res = notify_reload(server_url, domain, token)
    log = get_run_logger()
    if res.ok:
        log.info(f"serving reloaded {domain}: {res.url} -> {res.status}")
    else:
        log.warning(f"serving reload of {domain} failed ({res.error or res.status}); serving will "
                    f"pick up the new champion when it next polls the registry aliases")
    return res


# --------------------------------------------------------------------------------------- compute
@task(name="train-drafter", task_run_name="train-{domain}", **CACHED)
def _train(ctx: StepContext, domain: str, snapshots: list[str], out_dir: str, init: str | None, budget: Budget,
           steps: int, key: str) -> dict:
    tgt = load_target(ctx.target, ctx.home, ctx.dtype)
    with _Step(ctx.workdir, f"train-{domain}", key) as step:
        res = pipeline.train_with_budget(tgt, pipeline.examples_from_snapshots(snapshots), Path(out_dir), budget,
                                         steps, Path(init) if init else None, extra_meta={"domain": domain},
                                         home=Path(ctx.home))
        return step.done(res.to_dict(), resumed_from=res.resumed_from, steps=res.steps)


def train(ctx: StepContext, domain: str, snapshots: list[str], out_dir: str, init: str | None, budget: Budget,
          steps: int, key: str) -> TrainSummary:
    """Train (or resume training) a DSpark drafter on the snapshots' traces, warm-started from ``init``."""
    return TrainSummary.from_dict(_train(ctx, domain, snapshots, out_dir, init, budget, steps, key))


@task(name="calibrate-drafter", task_run_name="calibrate-{domain}", **CACHED)
def _calibrate(ctx: StepContext, domain: str, checkpoint: str, heldout: str, budget: Budget, key: str) -> dict:
    tgt, b = load_target(ctx.target, ctx.home, ctx.dtype), budget
    with _Step(ctx.workdir, f"calibrate-{domain}", key) as step:
        prompts = pipeline.heldout_prompts(pipeline.read_records(Path(heldout)), b.calib_prompts)
        res = pipeline.calibrate_drafter(tgt, Path(checkpoint), prompts, Path(checkpoint) / f"calibration-{domain}.json",
                                         b.calib_max_new_tokens, b.calib_temperature, b.min_rounds, b.seed)
        return step.done(res.to_dict(), rounds=res.rounds)


def calibrate(ctx: StepContext, domain: str, checkpoint: str, heldout: str, budget: Budget,
              key: str) -> CalibrationSummary:
    return CalibrationSummary.from_dict(_calibrate(ctx, domain, checkpoint, heldout, budget, key))


@task(name="profile-sps", task_run_name="profile-sps-{domain}", **CACHED)
def _profile(ctx: StepContext, domain: str, checkpoint: str, budget: Budget, key: str) -> dict:
    tgt = load_target(ctx.target, ctx.home, ctx.dtype)
    with _Step(ctx.workdir, f"profile-sps-{domain}", key) as step:
        res = pipeline.profile_drafter(tgt, Path(checkpoint), Path(checkpoint) / "sps.json", budget.sps_config())
        return step.done(res.to_dict())


def profile(ctx: StepContext, domain: str, checkpoint: str, budget: Budget, key: str) -> ProfileSummary:
    return ProfileSummary.from_dict(_profile(ctx, domain, checkpoint, budget, key))


@task(name="evaluate-drafter", task_run_name="evaluate-{domain}", **CACHED)
def _evaluate(ctx: StepContext, domain: str, checkpoint: str, heldout: str, baseline: str | None, budget: Budget,
              key: str) -> dict:
    tgt = load_target(ctx.target, ctx.home, ctx.dtype)
    with _Step(ctx.workdir, f"evaluate-{domain}", key) as step:
        prompts = pipeline.heldout_prompts(pipeline.read_records(Path(heldout)), budget.eval_prompts)
        res = pipeline.evaluate_drafter(tgt, Path(checkpoint), prompts, budget.eval_config(),
                                        baseline=Path(baseline) if baseline else None, log=print)
        return step.done(res.to_dict(), tau=res.drafter.tau)


def evaluate(ctx: StepContext, domain: str, checkpoint: str, heldout: str, baseline: str | None, budget: Budget,
             key: str) -> EvalSummary:
    """The challenger's held-out figures, and the ``baseline`` checkpoint's measured in the same run."""
    return EvalSummary.from_dict(_evaluate(ctx, domain, checkpoint, heldout, baseline, budget, key))


@task(name="lossless-check", task_run_name="lossless-{domain}", **CACHED)
def _lossless(ctx: StepContext, domain: str, checkpoint: str, heldout: str, budget: Budget, key: str) -> dict:
    tgt = load_target(ctx.target, ctx.home, "float32")
    with _Step(ctx.workdir, f"lossless-{domain}", key) as step:
        prompts = pipeline.heldout_prompts(pipeline.read_records(Path(heldout)), budget.lossless_prompts)
        res = pipeline.lossless_check(tgt, Path(checkpoint), prompts, budget.lossless_max_new_tokens,
                                      budget.eval_block_size)
        return step.done(res.to_dict(), failures=res.failures)


def lossless(ctx: StepContext, domain: str, checkpoint: str, heldout: str, budget: Budget,
             key: str) -> LosslessSummary:
    """Always in float32, whatever ``ctx.dtype``: there greedy speculation is exactly lossless."""
    return LosslessSummary.from_dict(_lossless(ctx, domain, checkpoint, heldout, budget, key))


@task(name="check-target", task_run_name="check-target-{domain}", cache_policy=NO_CACHE)
def check_target(domain: str, checkpoint: str, target_fingerprint: str) -> dict:
    """The checkpoint's metadata; raises DrafterMismatchError when it was trained for another target."""
    return pipeline.check_drafter_target(Path(checkpoint), target_fingerprint)


@task(name="checkpoint-digest", cache_policy=NO_CACHE)
def digest(checkpoint: str) -> str:
    return pipeline.checkpoint_digest(Path(checkpoint))
