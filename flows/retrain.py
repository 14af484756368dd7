"""The retraining flows: ingest traces, train, calibrate, profile SPS(B), evaluate, gate, promote, hand off.

``retrain`` is the parent. It ingests the landing folder, optionally keeps only the domains that
drifted, freezes each domain's traces into a snapshot, and plans each domain's warm start: the
domain's champion when one exists for this target, otherwise a generic DSpark drafter trained once on
all requested domains. Then it runs ``train_domain_drafter``, ``calibrate``, ``profile_sps`` and
``evaluate_and_promote`` for each domain in turn (one 2-core CPU gains nothing from running them side
by side). It ends with a Markdown report (a Prefect artifact, also written to
``$DSPARK_HOME/flows/reports/``). The flows hand each other and return the dataclasses of
:mod:`dspark_core.pipeline.steps` and :mod:`flows.results`.

Resume: every key below is derived from content (target fingerprint, the snapshot's request ids,
the budget, the warm start), and compute steps are cached on it with persisted results, so rerunning
after a crash skips what finished. A run over unchanged traces registers nothing new: registration is
idempotent on the same key.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from dspark_core.pipeline.steps import (Budget, CalibrationSummary, EvalSummary, LosslessSummary, ProfileSummary,
                                        TrainSummary, stable_key)
from registry.datasets import Snapshot
from registry.mlflow_registry import CHAMPION, DrafterRegistry, ModelVersionInfo
from registry.warehouse import LandingIngest

from . import report, tasks
from .results import (Baseline, Challenger, DomainOutcome, DriftReport, DriftVerdict, Metrics, RetrainSummary,
                      WarmStart)
from .settings import FlowSettings
from .tasks import StepContext


def _target_fingerprint(s: FlowSettings) -> str:
    return tasks.load_target(s.target, str(s.home), s.dtype).fingerprint


def _ctx(s: FlowSettings) -> StepContext:
    return StepContext(target=s.target, home=str(s.home), dtype=s.dtype, workdir=str(s.workdir))


@flow(name="ingest_traces", log_prints=True)
def ingest_traces() -> LandingIngest:
    """Ingest the landing folder into the warehouse (idempotent; bad lines go to quarantine)."""
    s = FlowSettings.from_env()
    res = tasks.ingest_landing(str(s.registry.warehouse), str(s.registry.landing), str(s.home / "targets"))
    print(f"ingest: {res.read} read, {res.stored} stored, {res.quarantined} quarantined, "
          f"{res.duplicates} duplicates; warehouse: {res.trace_rows} traces in {', '.join(res.domains)}")
    return res


@flow(name="drift_check", log_prints=True)
def drift_check(domains: list[str] | None = None, margin: float | None = None, window_hours: float | None = None,
                min_rounds: int | None = None, max_live_ece: float | None = None) -> DriftReport:
    """Domains whose live acceptance over the last ``window_hours`` fell below the champion's evaluated tau
    by more than ``margin`` (relative): ``live tau < champion tau x (1 - margin)``, judged only on at least
    ``min_rounds`` speculative rounds. With ``max_live_ece`` (``DSPARK_DRIFT_MAX_LIVE_ECE``) and a server
    (``DSPARK_SERVER_URL``), a domain has drifted too when serving's live calibrator measures the shipped
    calibration's worst per-position ECE above it over at least ``min_rounds`` fully verified rounds: the
    confidence head no longer reads this traffic, even where tau has held."""
    s = FlowSettings.from_env()
    margin = s.drift_margin if margin is None else margin
    window_hours = s.drift_window_hours if window_hours is None else window_hours
    min_rounds = s.drift_min_rounds if min_rounds is None else min_rounds
    max_live_ece = s.drift_max_live_ece if max_live_ece is None else max_live_ece
    since = (datetime.now(timezone.utc) - timedelta(hours=window_hours)).isoformat()
    reg = s.registry
    if domains is None:      # a listing, not a step: no task needed
        domains = DrafterRegistry(reg.tracking_uri, reg.artifact_location).domains()
    details, drifted = {}, []
    for d in domains:
        champ = tasks.champion(reg.tracking_uri, reg.artifact_location, d)
        if champ is None or "tau" not in champ.metrics:
            details[d] = DriftVerdict("no champion with an evaluated tau")
            continue
        live = tasks.live_acceptance(str(reg.warehouse), d, since)
        champ_tau = float(champ.metrics["tau"])
        threshold = champ_tau * (1 - margin)
        if live.rounds < min_rounds or live.tau is None:
            verdict = f"not enough evidence ({live.rounds} rounds < {min_rounds})"
        elif live.tau < threshold:
            verdict = f"drift: live tau {live.tau:.3f} < {threshold:.3f} (champion {champ_tau:.3f} - {margin:.0%})"
            drifted.append(d)
        else:
            verdict = f"ok: live tau {live.tau:.3f} >= {threshold:.3f}"
        cal = None
        if max_live_ece is not None and s.server_url:
            cal = tasks.serving_live_calibration(s.server_url, d, s.admin_token)
            worst = cal.worst_shipped
            if d not in drifted and cal.rounds >= min_rounds and worst is not None and worst > max_live_ece:
                verdict = (f"drift: live ECE of the shipped calibration {worst:.3f} > {max_live_ece:.3f} over "
                           f"{cal.rounds} rounds ({verdict})")
                drifted.append(d)
        details[d] = DriftVerdict(verdict, live, champ.version, champ_tau, cal)
        print(f"drift check {d}: {verdict}")
    return DriftReport(drifted, details, since, margin)


@flow(name="train_domain_drafter", log_prints=True)
def train_domain_drafter(domain: str, snapshots: list[str], out_dir: str, budget: Budget, steps: int, key: str,
                         init: str | None = None) -> TrainSummary:
    """Train (or resume training) a DSpark drafter on the snapshots' train traces, warm-started from ``init``."""
    s = FlowSettings.from_env()
    print(f"train {domain}: {steps} steps from {'warm start ' + init if init else 'scratch'} -> {out_dir}")
    return tasks.train(_ctx(s), domain, snapshots, out_dir, init, budget, steps, key)


@flow(name="calibrate", log_prints=True)
def calibrate(domain: str, checkpoint: str, heldout: str, budget: Budget, key: str) -> CalibrationSummary:
    """Refit Sequential Temperature Scaling on fully verified held-out rounds; reliability plot."""
    res = tasks.calibrate(_ctx(FlowSettings.from_env()), domain, checkpoint, heldout, budget, key)
    print(f"calibrate {domain}: {res.rounds} rounds, worst ECE {res.worst_ece_raw:.4f} -> "
          f"{res.worst_ece_calibrated:.4f}{' (fallback: too few rounds)' if res.fallback else ''}")
    return res


@flow(name="profile_sps", log_prints=True)
def profile_sps(domain: str, checkpoint: str, budget: Budget, key: str) -> ProfileSummary:
    """Measure SPS(B) (engine steps/s per verify batch, draft cost included) for this drafter."""
    return tasks.profile(_ctx(FlowSettings.from_env()), domain, checkpoint, budget, key)


@flow(name="evaluate_and_promote", log_prints=True)
def evaluate_and_promote(domain: str, challenger: Challenger, budget: Budget, min_tau_gain: float | None = None,
                         max_ece: float | None = None) -> DomainOutcome:
    """Evaluate the challenger (tau, speedup, lossless check) next to the champion, register it, and move
    ``champion`` only if :func:`registry.mlflow_registry.gate` says so; then ask serving to reload.

    A checkpoint trained for another target is refused before anything is measured or registered. A
    champion registered for another target does not count as a champion to beat."""
    s = FlowSettings.from_env()
    reg = s.registry
    gain = s.min_tau_gain if min_tau_gain is None else min_tau_gain
    bound = max_ece if max_ece is not None else s.max_ece if s.max_ece is not None else budget.max_ece
    fp = _target_fingerprint(s)
    tasks.check_target(domain, challenger.checkpoint, fp)
    key = stable_key([domain, fp, tasks.digest(challenger.checkpoint), Path(challenger.heldout).parent.name,
                      budget.to_dict()])
    idem = f"retrain-{domain}-{key}"
    champ = tasks.champion(reg.tracking_uri, reg.artifact_location, domain)
    known = tasks.find_registered(reg.tracking_uri, reg.artifact_location, domain, idem)
    if known is not None and CHAMPION in known.aliases:
        print(f"{domain}: v{known.version} (this checkpoint) is already the champion; nothing to do")
        return DomainOutcome(domain, known.version, known.model_uri, "already champion", False,
                             [f"v{known.version} is already the champion (nothing changed since)"], None,
                             known.metrics, challenger.reliability_plot, challenger.sps_plot)
    if champ is not None and champ.target_fingerprint != fp:
        get_run_logger().warning(f"{domain}: champion v{champ.version} belongs to another target; it does not count")
        champ = None
    baseline = None if champ is None else _download(s, domain, champ.version, fp)
    ctx = _ctx(s)
    ev = tasks.evaluate(ctx, domain, challenger.checkpoint, challenger.heldout, baseline, budget,
                        key=f"{key}-{champ.version if champ else 'none'}")
    ll = tasks.lossless(ctx, domain, challenger.checkpoint, challenger.heldout, budget, key=key)
    metrics = challenger_metrics(ev, ll, challenger)
    params = {"budget": budget.key(), **{f"budget.{k}": v for k, v in budget.to_dict().items()},
              "train_steps": challenger.train.steps if challenger.train else "unknown"}
    rv = tasks.register(reg.tracking_uri, reg.artifact_location, domain, challenger, params, metrics,
                        {"pipeline_key": key, **challenger.tags}, idempotency_key=idem, ctx=ctx)
    before = None if champ is None else _baseline(champ, ev)
    decision = tasks.gate(domain, metrics, None if champ is None else {**champ.metrics, "tau": before.tau}, gain,
                          bound)
    outcome = "promoted" if decision.promote else "refused"
    print(f"gate {domain} v{rv.version}: {outcome}: " + "; ".join(decision.reasons))
    handoff = None
    if decision.promote:
        tasks.promote(reg.tracking_uri, reg.artifact_location, domain, rv.version, "; ".join(decision.reasons))
        if s.server_url:
            handoff = tasks.serving_reload(s.server_url, domain, s.admin_token)
    return DomainOutcome(domain, rv.version, rv.model_uri, outcome, decision.promote, decision.reasons, before,
                         metrics, challenger.reliability_plot, challenger.sps_plot, handoff)


def challenger_metrics(ev: EvalSummary, ll: LosslessSummary, challenger: Challenger) -> Metrics:
    """The metrics registered with a challenger (MLflow names): held-out evaluation and lossless check,
    then calibration and training figures where the pipeline produced them."""
    metrics = {"tau": ev.drafter.tau, "acceptance_per_position": ev.drafter.acceptance_per_position,
               "speedup": ev.drafter.speedup, "tok_s": ev.drafter.tok_s, "plain_tok_s": ev.plain_tok_s,
               "eval_prompts": ev.drafter.prompts, "lossless_failures": ll.failures, "lossless_prompts": ll.prompts}
    if ev.drafter.speedup_range is not None:
        metrics |= {"speedup_low": ev.drafter.speedup_range[0], "speedup_high": ev.drafter.speedup_range[1]}
    if ev.versus is not None:      # challenger ÷ champion, measured in the same run, 5-95 % over paired prompts
        tau = ev.versus["tau_ratio"]
        metrics |= {"tau_vs_champion": tau["value"], "tau_vs_champion_low": tau["low"],
                    "tau_vs_champion_high": tau["high"]}
    cal = challenger.calibration
    if cal is not None:
        metrics |= {"ece_raw": cal.ece_raw, "ece_calibrated": cal.ece_calibrated, "ece_raw_worst": cal.worst_ece_raw,
                    "ece_calibrated_worst": cal.worst_ece_calibrated, "calibration_rounds": cal.rounds}
    if challenger.train is not None:
        final = challenger.train.final
        metrics |= {k2: final[k1] for k1, k2 in (("loss", "train_loss"), ("tau_expected", "train_tau_expected"))
                    if k1 in final}
    return metrics


def _baseline(champ: ModelVersionInfo, ev: EvalSummary) -> Baseline:
    """The champion as the gate sees it: tau and speedup re-measured next to the challenger, ECE as
    registered."""
    return Baseline(version=champ.version, tau=ev.baseline.tau, speedup=ev.baseline.speedup,
                    ece_raw=champ.metrics.get("ece_raw"), ece_calibrated=champ.metrics.get("ece_calibrated"))


def _download(s: FlowSettings, domain: str, version: int, fp: str) -> str:
    """A registered version's checkpoint under the work folder (fetched once per version and target)."""
    reg = s.registry
    return tasks.download(reg.tracking_uri, reg.artifact_location, domain, version,
                          str(s.workdir / "champions" / domain / f"v{version}"), key=f"{domain}-v{version}-{fp[:12]}")


def _check_counts(snap: Snapshot) -> None:
    if snap.heldout_count == 0 or snap.train_count == 0:
        raise ValueError(f"domain {snap.domain!r} has {snap.train_count} train and {snap.heldout_count} held-out "
                         f"traces; both are needed (bootstrap more prompts: dspark traces bootstrap --per-domain N)")


@flow(name="retrain", log_prints=True)
def retrain(domains: list[str] | None = None, budget: str = "default", budget_overrides: dict | None = None,
            drift_only: bool = False, min_tau_gain: float | None = None, max_ece: float | None = None) -> RetrainSummary:
    """Retrain, calibrate, profile, evaluate and (through the gate) promote each domain's drafter."""
    t0 = time.perf_counter()
    s = FlowSettings.from_env()
    b = Budget.preset_named(budget, **(budget_overrides or {}))
    ing = ingest_traces()
    drift = None
    if drift_only:
        drift = drift_check(domains=domains)
        domains = drift.drifted
    elif not domains:
        domains = ing.domains
    fp = _target_fingerprint(s)
    reg = s.registry
    results, errors = {}, {}
    snaps = {d: tasks.snapshot(str(reg.warehouse), str(s.home), d, fp, str(s.workdir / "data")) for d in domains}
    plans = {}
    for d in domains:
        try:
            _check_counts(snaps[d])
            plans[d] = tasks.plan(reg.tracking_uri, reg.artifact_location, d, fp,
                                  key=stable_key([fp, snaps[d].data_key, b.key()]))
        except ValueError as e:
            errors[d] = str(e)
            print(f"{d}: skipped: {e}")
    generic = _generic_drafter(s, [snaps[d] for d in plans], fp, b) if any(
        p.init == "generic" for p in plans.values()) else None
    for d, plan in plans.items():
        try:
            challenger = _train_challenger(s, snaps[d], plan, generic, fp, b)
            outcome = evaluate_and_promote(d, challenger, b, min_tau_gain=min_tau_gain, max_ece=max_ece)
            results[d] = replace(outcome, warm_start=challenger.tags["warm_start"])
        except Exception as e:  # one domain's failure must not stop the others; the flow fails at the end
            errors[d] = f"{type(e).__name__}: {e}"
            get_run_logger().error(f"{d}: {type(e).__name__}: {e}")
    summary = RetrainSummary(budget=budget, target_fingerprint=fp, domains=list(domains), ingest=ing, drift=drift,
                             results=results, errors=errors, seconds=round(time.perf_counter() - t0, 1))
    summary = replace(summary, report=_publish_report(s, summary))
    if errors:
        raise RuntimeError("retrain failed for " + "; ".join(f"{d}: {e}" for d, e in errors.items()))
    return summary


def _generic_drafter(s: FlowSettings, snaps: list[Snapshot], fp: str, b: Budget) -> str:
    """The generic DSpark drafter trained once on every planned domain's train traces (its checkpoint)."""
    gkey = f"generic-{fp[:12]}-{b.key(generic=True)}"
    return train_domain_drafter("generic", [snap.train for snap in snaps], str(s.workdir / "drafters" / gkey), b,
                                b.generic_steps, key=gkey).checkpoint


def _train_challenger(s: FlowSettings, snap: Snapshot, plan: WarmStart, generic: str | None, fp: str,
                      b: Budget) -> Challenger:
    """Train one domain's drafter from its warm start, then calibrate it and profile its SPS(B)."""
    d = snap.domain
    if plan.init == "champion":
        init, init_id = _download(s, d, plan.version, fp), f"champion-v{plan.version}"
    else:
        init, init_id = generic, Path(generic).name
    tkey = stable_key([fp, snap.data_key, b.key(), init_id])
    out = str(s.workdir / "drafters" / d / tkey)
    trained = train_domain_drafter(d, [snap.train], out, b, b.steps, key=tkey, init=init)
    cal = calibrate(d, out, snap.heldout, b, key=tkey)
    sps = profile_sps(d, out, b, key=tkey)
    tags = {"trace_window": snap.trace_window, "trace_count": str(snap.train_count), "data_key": snap.data_key,
            "warm_start": init_id}
    return Challenger(out, snap.heldout, calibration=cal, sps=sps, train=trained, tags=tags)


def _publish_report(s: FlowSettings, summary: RetrainSummary) -> str:
    md = report.render(summary)
    path = s.workdir / "reports" / f"retrain-{time.strftime('%Y%m%d-%H%M%S')}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(md)
    create_markdown_artifact(markdown=md, key="retrain-report", description="before/after per domain")
    return str(path)
