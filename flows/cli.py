"""``dspark flow run retrain|ingest|drift``, ``dspark flow serve`` and ``dspark flow demo``: plugged into the core CLI through
the ``dspark.commands`` entry point group. Prefect is imported only when a flow verb runs, after the
Prefect environment defaults below are in place (Prefect reads its settings on import).

``flow run`` prints a short table per domain by default and the flow's whole result as JSON with
``--json``; the table printer and the one-line error come from the entry point's CommandKit (``args.kit``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DEFAULT_INGEST_CRON = "0 * * * *"          # hourly
DEFAULT_RETRAIN_CRON = "0 3 * * *"         # nightly at 03:00
DEFAULT_DRIFT_CRON = "30 * * * *"          # hourly, half past


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prefect_env_defaults(home: Path) -> dict[str, str]:
    """Prefect settings that keep a local run self-contained under DSPARK_HOME; each applies only when the
    variable is unset. With ``PREFECT_API_URL`` set (a ``prefect server start``), ``PREFECT_HOME`` is left
    alone so the user's profile still applies. Results (the resume cache) always default under DSPARK_HOME."""
    env = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "prefect" / "results")}
    if not os.environ.get("PREFECT_API_URL"):
        env["PREFECT_HOME"] = str(home / "prefect")
    return {k: v for k, v in env.items() if not os.environ.get(k)}


def _prepare() -> None:
    from registry.cli import RegistrySettings
    home = RegistrySettings.from_env().home
    for k, v in prefect_env_defaults(home).items():
        os.environ[k] = v
    if "prefect" in sys.modules:
        _log("note: Prefect was imported before its DSPARK_HOME defaults were set; using its current settings")


def _domains(text: str | None, error: type[Exception]) -> list[str] | None:
    if not text:
        return None
    domains = [d.strip() for d in text.split(",") if d.strip()]
    import re
    bad = [d for d in domains if not re.match(r"^[a-z0-9][a-z0-9_-]*$", d)]
    if bad or not domains:
        raise error(f"bad domain {bad[0]!r}" if bad else "--domains is empty", "e.g. --domains code,math")
    return domains


def _budget(args) -> str:
    return "quick" if args.quick else args.budget


def cmd_run(args, _settings) -> int:
    _prepare()
    from .retrain import drift_check, ingest_traces, retrain
    if args.flow == "ingest":
        out = ingest_traces()
    elif args.flow == "drift":
        out = drift_check(domains=_domains(args.domains, args.kit.error), margin=args.margin)
    else:
        overrides = {}
        for item in args.set or []:
            k, _, v = item.partition("=")
            if not _ or not k:
                raise args.kit.error(f"--set {item!r} is not KEY=VALUE", "e.g. --set steps=40")
            try:
                overrides[k] = json.loads(v)
            except json.JSONDecodeError:
                overrides[k] = v
        try:
            out = retrain(domains=_domains(args.domains, args.kit.error), budget=_budget(args), budget_overrides=overrides or None,
                          drift_only=args.drift_only, min_tau_gain=args.min_tau_gain, max_ece=args.max_ece)
        except RuntimeError as e:
            raise args.kit.error(str(e), "see the report and the log above; fix the cause and rerun (finished steps "
                           "are not redone)") from None
    out = _plain(out)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print({"retrain": _retrain_table, "ingest": _ingest_table, "drift": _drift_table}[args.flow](out, args.kit.table))
    return 0


def _plain(result) -> dict:
    """A flow's result as JSON-ready data (its ``to_dict()``)."""
    return result.to_dict() if hasattr(result, "to_dict") else result


def _retrain_table(out: dict, table) -> str:
    """A row per domain: the version registered, the gate's decision, tau and speedup before (the champion)
    and after, the worst calibrated ECE, lossless failures; then the report's path."""
    rows = []
    for d, o in out["results"].items():
        before, after = o.get("before") or {}, o.get("after") or {}
        rows.append({"domain": d, "version": o["version"], "decision": o["decision"], "tau before": before.get("tau"),
                     "tau": after.get("tau"), "speedup before": before.get("speedup"), "speedup": after.get("speedup"),
                     "ece": after.get("ece_calibrated_worst"), "lossless failures": after.get("lossless_failures"),
                     "warm start": o.get("warm_start")})
    lines = [table(rows) if rows else "no domain retrained"]
    drift = out.get("drift")
    if drift is not None and not rows:
        lines.append(f"no domain drifted (margin {drift['margin']:.0%})")
    lines.append(f"report: {out['report']} ({out['seconds']:.0f} s)")
    return "\n".join(lines)


def _ingest_table(out: dict, table) -> str:
    """One row: this pass's counts, then the warehouse's traces and domains after it."""
    return table([{k: out.get(k) for k in ("files", "read", "stored", "quarantined", "duplicates", "trace_rows")}
                  | {"domains": ",".join(out.get("domains") or []) or None}])


def _drift_table(out: dict, table) -> str:
    """A row per domain: its champion's evaluated tau, the live tau and rounds, the verdict; then which drifted."""
    rows = [{"domain": d, "champion": v.get("champion_version"), "champion tau": v.get("champion_tau"),
             "live tau": (v.get("live") or {}).get("tau"), "live rounds": (v.get("live") or {}).get("rounds"),
             "verdict": v["verdict"]} for d, v in out["details"].items()]
    drifted = ", ".join(out["drifted"]) or "none"
    return "\n".join([table(rows) if rows else "no domain checked",
                      f"drifted: {drifted} (margin {out['margin']:.0%}, live traces since {out['since']})"])


def cmd_serve(args, _settings) -> int:
    _prepare()
    from prefect import serve

    from .retrain import ingest_traces, retrain
    params = {"budget": _budget(args)}
    if args.domains:
        params["domains"] = _domains(args.domains, args.kit.error)
    deployments = [
        ingest_traces.to_deployment(name="hourly-ingest", cron=args.ingest_cron),
        retrain.to_deployment(name="nightly-retrain", cron=args.retrain_cron, parameters=params),
        retrain.to_deployment(name="drift-retrain", cron=args.drift_cron, parameters={**params, "drift_only": True}),
    ]
    api = os.environ.get("PREFECT_API_URL") or "an ephemeral Prefect server (set PREFECT_API_URL for a real one)"
    _log(f"serving 3 deployments on {api}: hourly-ingest '{args.ingest_cron}', nightly-retrain "
         f"'{args.retrain_cron}', drift-retrain '{args.drift_cron}' (Ctrl-C stops)")
    serve(*deployments, limit=1)
    return 0


def cmd_demo(args, _settings) -> int:
    _prepare()
    from .demo import closed_loop_demo
    domains = _domains(args.domains, args.kit.error)
    out = closed_loop_demo(domains=domains, per_domain=args.per_domain, traffic_per_domain=args.traffic,
                           max_tokens=args.max_tokens, concurrency=args.concurrency)
    if args.json:
        print(json.dumps(_plain(out), indent=2, default=str))
    return 0


def add_commands(sub, kit) -> None:
    """Entry point: add the ``flow`` verbs to the dspark parser. ``kit`` is the entry point's CommandKit;
    the verbs read it back as ``args.kit`` (its ``error`` is the CLI's one-line error with a hint)."""
    fp = sub.add_parser("flow", help="Prefect pipeline: ingest, retrain, drift check; serve them on schedules")
    fsub = fp.add_subparsers(dest="action", metavar="ACTION")
    fsub.required = True
    p = fsub.add_parser("run", help="run one flow now (ephemeral Prefect unless PREFECT_API_URL is set)",
                        description="Run one flow now (ephemeral Prefect unless PREFECT_API_URL is set; its log "
                        "goes to stderr). Prints a table: retrain, a row per domain (version, gate decision, tau "
                        "and speedup before and after, ECE, lossless failures) and the report's path; ingest, the "
                        "counts; drift, a row per domain with its verdict.")
    p.add_argument("flow", choices=["retrain", "ingest", "drift"])
    p.add_argument("--domains", help="comma-separated (default: every domain in the warehouse)")
    p.add_argument("--quick", action="store_true", help="the quick budget (minutes on a 2-core CPU)")
    p.add_argument("--budget", default="default", choices=["default", "quick", "tiny"])
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a budget field, e.g. steps=40")
    p.add_argument("--drift-only", action="store_true", help="retrain only the domains whose live acceptance drifted")
    p.add_argument("--margin", type=float, default=None, help="drift: relative tau drop that triggers (default "
                   "DSPARK_DRIFT_MARGIN or 0.10)")
    p.add_argument("--min-tau-gain", type=float, default=None, help="gate: default DSPARK_GATE_MIN_TAU_GAIN or 0.02")
    p.add_argument("--max-ece", type=float, default=None, help="gate: default DSPARK_GATE_MAX_ECE or the budget's "
                   "(default 0.10, quick 0.20)")
    p.add_argument("--json", action="store_true", help="print the flow's whole result as JSON")
    p.set_defaults(func=cmd_run, kit=kit)
    p = fsub.add_parser("serve", help="register the scheduled deployments and run them (prefect.serve)",
                        description="Register the hourly ingest, the nightly retrain and the drift retrain as "
                        "scheduled deployments and run them until Ctrl-C (prefect.serve). Prints only log lines.")
    p.add_argument("--ingest-cron", default=DEFAULT_INGEST_CRON, help="default: %(default)s")
    p.add_argument("--retrain-cron", default=DEFAULT_RETRAIN_CRON, help="default: %(default)s")
    p.add_argument("--drift-cron", default=DEFAULT_DRIFT_CRON, help="default: %(default)s")
    p.add_argument("--domains", help="domains the scheduled retrains cover (default: all in the warehouse)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget", default="default", choices=["default", "quick", "tiny"])
    p.set_defaults(func=cmd_serve, kit=kit)
    p = fsub.add_parser("demo", help="the closed loop on this machine: bootstrap, train, register, serve, traffic, "
                        "retrain on that traffic, promote and hot-swap, before/after table (make demo)",
                        description="The closed loop on this machine: bootstrap, train, register, serve, traffic, "
                        "retrain on that traffic, promote and hot-swap. Prints its progress and a before/after "
                        "table; --json also prints the whole result as JSON.")
    p.add_argument("--domains", help="comma-separated (default: chat,code,math)")
    p.add_argument("--per-domain", type=int, default=20, help="bootstrap prompts per domain (default: %(default)s)")
    p.add_argument("--traffic", type=int, default=12, help="served requests per domain (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4, help="parallel client requests (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="also print the whole result as JSON")
    p.set_defaults(func=cmd_demo, kit=kit)
