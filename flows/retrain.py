"""The retraining flows: ingest traces, train, calibrate, profile SPS(B), evaluate, gate, promote, hand off.

``retrain`` is the parent. It ingests the landing folder, optionally keeps only the domains that
drifted, freezes each domain's traces into a snapshot, and plans each domain's warm start: the
domain's champion when one exists for this target, otherwise a generic DSpark drafter trained once on
all requested domains. Then it runs ``train_domain_drafter``, ``calibrate``, ``profile_sps`` and
``evaluate_and_promote`` for each domain in turn (one 2-core CPU gains nothing from running them side
by side). It ends with a Markdown report (a Prefect artifact, also written to
``$DSPARK_HOME/flows/reports/``).

Resume: every key below is derived from content (target fingerprint, the snapshot's request ids,
the budget, the warm start), and compute steps are cached on it with persisted results, so rerunning
after a crash skips what finished. A run over unchanged traces registers nothing new: registration is
idempotent on the same key.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from dspark_core.pipeline.steps import Budget, stable_key

from . import report, tasks
from .settings import FlowSettings


def _target_fingerprint(s: FlowSettings) -> str:
    return tasks.load_target(s.target, str(s.home), s.dtype).fingerprint


def _common(s: FlowSettings) -> dict:
    return {"target": s.target, "home": str(s.home), "workdir": str(s.workdir)}


@flow(name="ingest_traces", log_prints=True)
def ingest_traces() -> dict:
    """Ingest the landing folder into the warehouse (idempotent; bad lines go to quarantine)."""
    s = FlowSettings.from_env()
    res = tasks.ingest_landing(str(s.registry.warehouse), str(s.registry.landing))
    print(f"ingest: {res['read']} read, {res['stored']} stored, {res['quarantined']} quarantined, "
          f"{res['duplicates']} duplicates; warehouse: {res['trace_rows']} traces in {', '.join(res['domains'])}")
    return res


@flow(name="drift_check", log_prints=True)
def drift_check(domains: list[str] | None = None, margin: float | None = None, window_hours: float | None = None,
                min_rounds: int | None = None) -> dict:
    """Domains whose live acceptance over the last ``window_hours`` fell below the champion's evaluated tau
    by more than ``margin`` (relative): ``live tau < champion tau x (1 - margin)``, judged only on at least
    ``min_rounds`` speculative rounds. Returns ``drifted`` and the evidence per domain."""
    s = FlowSettings.from_env()
    margin = s.drift_margin if margin is None else margin
    window_hours = s.drift_window_hours if window_hours is None else window_hours
    min_rounds = s.drift_min_rounds if min_rounds is None else min_rounds
    since = (datetime.now(timezone.utc) - timedelta(hours=window_hours)).isoformat()
    reg = s.registry
    if domains is None:
        from registry.mlflow_registry import DrafterRegistry  # a listing, not a step: no task needed
        domains = DrafterRegistry(reg.tracking_uri, reg.artifact_location).domains()
    details, drifted = {}, []
    for d in domains:
        champ = tasks.champion(reg.tracking_uri, reg.artifact_location, d)
        if champ is None or "tau" not in champ["metrics"]:
            details[d] = {"verdict": "no champion with an evaluated tau"}
            continue
        live = tasks.live_acceptance(str(reg.warehouse), d, since)
        champ_tau = float(champ["metrics"]["tau"])
        threshold = champ_tau * (1 - margin)
        if live["rounds"] < min_rounds or live["tau"] is None:
            verdict = f"not enough evidence ({live['rounds']} rounds < {min_rounds})"
        elif live["tau"] < threshold:
            verdict = f"drift: live tau {live['tau']:.3f} < {threshold:.3f} (champion {champ_tau:.3f} - {margin:.0%})"
            drifted.append(d)
        else:
            verdict = f"ok: live tau {live['tau']:.3f} >= {threshold:.3f}"
        details[d] = {"verdict": verdict, "live": live, "champion_version": champ["version"], "champion_tau": champ_tau}
        print(f"drift check {d}: {verdict}")
    return {"drifted": drifted, "details": details, "since": since, "margin": margin}


@flow(name="train_domain_drafter", log_prints=True)
def train_domain_drafter(domain: str, snapshots: list[str], out_dir: str, budget: dict, steps: int, key: str,
                         init: str | None = None) -> dict:
    """Train (or resume training) a DSpark drafter on the snapshots' train traces, warm-started from ``init``."""
    s = FlowSettings.from_env()
    print(f"train {domain}: {steps} steps from {'warm start ' + init if init else 'scratch'} -> {out_dir}")
    return tasks.train(dtype=s.dtype, domain=domain, snapshots=snapshots, out_dir=out_dir, init=init, budget=budget,
                       steps=steps, key=key, **_common(s))


@flow(name="calibrate", log_prints=True)
def calibrate(domain: str, checkpoint: str, heldout: str, budget: dict, key: str) -> dict:
    """Refit Sequential Temperature Scaling on fully verified held-out rounds; reliability plot."""
    s = FlowSettings.from_env()
    res = tasks.calibrate(dtype=s.dtype, domain=domain, checkpoint=checkpoint, heldout=heldout, budget=budget,
                          key=key, **_common(s))
    print(f"calibrate {domain}: {res['rounds']} rounds, worst ECE {max(res['ece_raw']):.4f} -> "
          f"{max(res['ece_calibrated']):.4f}{' (fallback: too few rounds)' if res['fallback'] else ''}")
    return res


@flow(name="profile_sps", log_prints=True)
def profile_sps(domain: str, checkpoint: str, budget: dict, key: str) -> dict:
    """Measure SPS(B) (engine steps/s per verify batch, draft cost included) for this drafter."""
    s = FlowSettings.from_env()
    return tasks.profile(dtype=s.dtype, domain=domain, checkpoint=checkpoint, budget=budget, key=key, **_common(s))


@flow(name="evaluate_and_promote", log_prints=True)
def evaluate_and_promote(domain: str, checkpoint: str, heldout: str, budget: dict, calibration: dict | None = None,
                         sps: dict | None = None, train: dict | None = None, tags: dict | None = None,
                         min_tau_gain: float | None = None, max_ece: float | None = None) -> dict:
    """Evaluate the challenger (tau, speedup, lossless check) next to the champion, register it, and move
    ``champion`` only if :func:`registry.mlflow_registry.gate` says so; then ask serving to reload.

    A checkpoint trained for another target is refused before anything is measured or registered. A
    champion registered for another target does not count as a champion to beat."""
    s, log = FlowSettings.from_env(), get_run_logger()
    reg = s.registry
    gain = s.min_tau_gain if min_tau_gain is None else min_tau_gain
    bound = max_ece if max_ece is not None else s.max_ece if s.max_ece is not None else Budget(**budget).max_ece
    fp = _target_fingerprint(s)
    tasks.check_target(domain, checkpoint, fp)
    key = stable_key([domain, fp, tasks.digest(checkpoint), Path(heldout).parent.name, Budget(**budget).to_dict()])
    idem = f"retrain-{domain}-{key}"
    champ = tasks.champion(reg.tracking_uri, reg.artifact_location, domain)
    known = tasks.find_registered(reg.tracking_uri, reg.artifact_location, domain, idem)
    if known is not None and "champion" in known["aliases"]:
        print(f"{domain}: v{known['version']} (this checkpoint) is already the champion; nothing to do")
        return {"domain": domain, "version": known["version"], "model_uri": known["model_uri"], "before": None,
                "after": known["metrics"], "decision": "already champion", "promoted": False, "handoff": None,
                "reasons": [f"v{known['version']} is already the champion (nothing changed since)"],
                "reliability_plot": (calibration or {}).get("plot"), "sps_plot": (sps or {}).get("plot")}
    if champ is not None and champ["tags"].get("target_fingerprint") != fp:
        log.warning(f"{domain}: champion v{champ['version']} belongs to another target; it does not count")
        champ = None
    baseline = None
    if champ is not None:
        dst = s.workdir / "champions" / domain / f"v{champ['version']}"
        baseline = tasks.download(reg.tracking_uri, reg.artifact_location, domain, champ["version"], str(dst),
                                  key=f"{domain}-v{champ['version']}-{fp[:12]}")
    common = _common(s)
    ev = tasks.evaluate(dtype=s.dtype, domain=domain, checkpoint=checkpoint, heldout=heldout, baseline=baseline,
                        budget=budget, key=f"{key}-{champ['version'] if champ else 'none'}", **common)
    ll = tasks.lossless(domain=domain, checkpoint=checkpoint, heldout=heldout, budget=budget, key=key, **common)
    metrics = {"tau": ev["tau"], "acceptance_per_position": ev["acceptance_per_position"], "speedup": ev["speedup"],
               "tok_s": ev["tok_s"], "plain_tok_s": ev["plain_tok_s"], "eval_prompts": ev["prompts"],
               "lossless_failures": ll["failures"], "lossless_prompts": ll["prompts"]}
    if calibration:
        metrics |= {"ece_raw": calibration["ece_raw"], "ece_calibrated": calibration["ece_calibrated"],
                    "ece_raw_worst": max(calibration["ece_raw"]), "ece_calibrated_worst": max(calibration["ece_calibrated"]),
                    "calibration_rounds": calibration["rounds"]}
    if train:
        final = train.get("final", {})
        metrics |= {k2: final[k1] for k1, k2 in (("loss", "train_loss"), ("tau_expected", "train_tau_expected"))
                    if k1 in final}
    params = {"budget": Budget(**budget).key(), **{f"budget.{k}": v for k, v in budget.items()},
              "train_steps": (train or {}).get("steps", "unknown")}
    plots = [p for p in ((calibration or {}).get("plot"), (sps or {}).get("plot")) if p]
    version_tags = {"pipeline_key": key, **(tags or {})}
    rv = tasks.register(reg.tracking_uri, reg.artifact_location, domain, checkpoint, params, metrics,
                        (calibration or {}).get("calibration"), (sps or {}).get("sps"), plots, version_tags,
                        idempotency_key=idem)
    before = None
    if champ is not None:
        before = {**{k: champ["metrics"].get(k) for k in ("ece_raw", "ece_calibrated")},
                  "tau": ev["baseline"]["tau"], "speedup": ev["baseline"]["speedup"], "version": champ["version"]}
    outcome = {"domain": domain, "version": rv["version"], "model_uri": rv["model_uri"], "before": before,
               "after": metrics, "reliability_plot": (calibration or {}).get("plot"),
               "sps_plot": (sps or {}).get("plot"), "handoff": None}
    champion_metrics = None if champ is None else {**champ["metrics"], "tau": ev["baseline"]["tau"]}
    decision = tasks.gate(domain, metrics, champion_metrics, gain, bound)
    outcome |= {"promoted": decision["promote"], "reasons": decision["reasons"],
                "decision": "promoted" if decision["promote"] else "refused"}
    print(f"gate {domain} v{rv['version']}: {outcome['decision']}: " + "; ".join(decision["reasons"]))
    if decision["promote"]:
        tasks.promote(reg.tracking_uri, reg.artifact_location, domain, rv["version"], "; ".join(decision["reasons"]))
        if s.server_url:
            outcome["handoff"] = tasks.serving_reload(s.server_url, domain, s.admin_token)
    return outcome


def _check_counts(domain: str, snap: dict) -> None:
    if snap["heldout_count"] == 0 or snap["train_count"] == 0:
        raise ValueError(f"domain {domain!r} has {snap['train_count']} train and {snap['heldout_count']} held-out "
                         f"traces; both are needed (bootstrap more prompts: dspark traces bootstrap --per-domain N)")


@flow(name="retrain", log_prints=True)
def retrain(domains: list[str] | None = None, budget: str = "default", budget_overrides: dict | None = None,
            drift_only: bool = False, min_tau_gain: float | None = None, max_ece: float | None = None) -> dict:
    """Retrain, calibrate, profile, evaluate and (through the gate) promote each domain's drafter."""
    t0 = time.perf_counter()
    s = FlowSettings.from_env()
    b = Budget.preset_named(budget, **(budget_overrides or {}))
    ing = ingest_traces()
    drift = None
    if drift_only:
        drift = drift_check(domains=domains)
        domains = drift["drifted"]
    elif not domains:
        domains = ing["domains"]
    fp = _target_fingerprint(s)
    reg, common = s.registry, _common(s)
    summary = {"budget": budget, "target_fingerprint": fp, "domains": list(domains), "ingest": ing, "drift": drift,
               "results": {}, "errors": {}}
    snaps = {d: tasks.snapshot(str(reg.warehouse), str(s.home), d, fp, str(s.workdir / "data")) for d in domains}
    plans = {}
    for d in domains:
        try:
            _check_counts(d, snaps[d])
            plans[d] = tasks.plan(reg.tracking_uri, reg.artifact_location, d, fp,
                                  key=stable_key([fp, snaps[d]["data_key"], b.key()]))
        except ValueError as e:
            summary["errors"][d] = str(e)
            print(f"{d}: skipped: {e}")
    generic = None
    if any(p["init"] == "generic" for p in plans.values()):
        gkey = f"generic-{fp[:12]}-{b.key(generic=True)}"
        generic = train_domain_drafter("generic", [snaps[d]["train"] for d in plans], str(s.workdir / "drafters" / gkey),
                                       b.to_dict(), b.generic_steps, key=gkey)["checkpoint"]
    for d, plan in plans.items():
        try:
            summary["results"][d] = _retrain_domain(s, d, snaps[d], plan, generic, fp, b, min_tau_gain, max_ece)
        except Exception as e:  # one domain's failure must not stop the others; the flow fails at the end
            summary["errors"][d] = f"{type(e).__name__}: {e}"
            get_run_logger().error(f"{d}: {type(e).__name__}: {e}")
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["report"] = _publish_report(s, summary)
    if summary["errors"]:
        raise RuntimeError("retrain failed for " + "; ".join(f"{d}: {e}" for d, e in summary["errors"].items()))
    return summary


def _retrain_domain(s: FlowSettings, d: str, snap: dict, plan: dict, generic: str | None, fp: str, b: Budget,
                    min_tau_gain: float | None, max_ece: float | None) -> dict:
    reg = s.registry
    if plan["init"] == "champion":
        v = plan["version"]
        init = tasks.download(reg.tracking_uri, reg.artifact_location, d, v,
                              str(s.workdir / "champions" / d / f"v{v}"), key=f"{d}-v{v}-{fp[:12]}")
        init_id = f"champion-v{v}"
    else:
        init, init_id = generic, Path(generic).name
    tkey = stable_key([fp, snap["data_key"], b.key(), init_id])
    out = str(s.workdir / "drafters" / d / tkey)
    trained = train_domain_drafter(d, [snap["train"]], out, b.to_dict(), b.steps, key=tkey, init=init)
    cal = calibrate(d, out, snap["heldout"], b.to_dict(), key=tkey)
    sps = profile_sps(d, out, b.to_dict(), key=tkey)
    tags = {"trace_window": snap["trace_window"], "trace_count": snap["train_count"], "data_key": snap["data_key"],
            "warm_start": init_id}
    return evaluate_and_promote(d, out, snap["heldout"], b.to_dict(), calibration=cal, sps=sps, train=trained,
                                tags=tags, min_tau_gain=min_tau_gain, max_ece=max_ece) | {"warm_start": init_id}


def _publish_report(s: FlowSettings, summary: dict) -> str:
    md = report.render(summary)
    path = s.workdir / "reports" / f"retrain-{time.strftime('%Y%m%d-%H%M%S')}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(md)
    create_markdown_artifact(markdown=md, key="retrain-report", description="before/after per domain")
    return str(path)
