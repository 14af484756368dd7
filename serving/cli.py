"""``dspark serve``: plugged into the core CLI through the ``dspark.commands`` entry point group.

The only module of serving/ that reads argv and the environment (``DSPARK_HOME``, ``DSPARK_ADMIN_TOKEN``,
the registry variables of :class:`registry.cli.RegistrySettings`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from .settings import POLICIES, ServeSettings

log = logging.getLogger("dspark.serving")


def settings_from_args(args, env=os.environ) -> ServeSettings:
    from registry.cli import RegistrySettings
    reg = RegistrySettings.from_env()
    tracking = None
    if not args.no_registry and not args.drafter_dir:
        uri = reg.tracking_uri
        db = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
        tracking = uri if db is None or db.exists() else None
        if tracking is None:
            log.warning("no MLflow registry at %s: domains run without speculation unless --drafter-dir is given", uri)
    domains = tuple(d.strip() for d in (args.domains or "").split(",") if d.strip())
    return ServeSettings(
        home=reg.home, landing=reg.landing, host=args.host, port=args.port, max_batch=args.max_batch,
        policy=args.policy, shadow_fraction=args.shadow_fraction, poll_interval=args.poll_interval,
        domains=domains, default_domain=args.default_domain, alias=args.alias,
        drafter_dir=Path(args.drafter_dir) if args.drafter_dir else None, tracking_uri=tracking,
        artifact_location=reg.artifact_location, sps_path=Path(args.sps) if args.sps else None,
        live_gate=not args.no_live_gate, length_gate=not args.no_length_gate, gate_hurdle=args.gate_hurdle,
        gate_explore_budget=args.gate_explore_budget,
        max_model_len=args.max_model_len, max_tokens_default=args.max_tokens_default,
        canary_rounds=args.canary_rounds, canary_ratio=args.canary_ratio, acceptance_window=args.acceptance_window,
        max_draft_tokens=args.max_draft_tokens, prompt_lookup=args.prompt_lookup,
        traces=not args.no_traces, trace_buffer=args.trace_buffer, trace_rotate_bytes=int(args.trace_rotate_mb * 2**20),
        admin_token=env.get("DSPARK_ADMIN_TOKEN") or None, served_model_name=args.served_model_name,
        max_request_bytes=int(args.max_request_mb * 2**20), max_queued=args.max_queued,
        live_calibration=not args.no_live_calibration,
        live_calibration_off=tuple(d.strip() for d in (args.live_calibration_off or "").split(",") if d.strip()),
        memory_trim_interval=args.memory_trim_interval, live_window=args.live_window,
        live_refit_every=args.live_refit_every, live_min_rounds=args.live_min_rounds,
        live_max_backoff=args.live_max_backoff, live_request_prior=args.live_request_prior)


def make_source(settings: ServeSettings, target):
    from .drafters import LocalSource, NoSource, RegistrySource
    if settings.drafter_dir is not None:
        if not settings.drafter_dir.is_dir():
            raise FileNotFoundError(f"--drafter-dir {settings.drafter_dir} is not a folder")
        return LocalSource(settings.drafter_dir, target.runner, target.fingerprint, settings.acceptance_window,
                           settings.max_draft_tokens, settings.prompt_lookup)
    if settings.tracking_uri is not None:
        from registry.mlflow_registry import DrafterRegistry
        reg = DrafterRegistry(settings.tracking_uri, settings.artifact_location)
        return RegistrySource(reg, settings.drafter_cache, target.runner, target.fingerprint,
                              settings.acceptance_window, settings.max_draft_tokens, settings.prompt_lookup)
    return NoSource()


def cmd_serve(args, core_settings) -> int:
    import uvicorn

    from .app import create_app
    from .server import build_server
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        raise args.kit.error(str(e), "see: dspark serve --help") from None
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.admin_token:
        log.warning("binding %s without DSPARK_ADMIN_TOKEN: the admin API stays off", settings.host)
    target = args.kit.load_target(args, core_settings)
    state = build_server(settings, target, make_source(settings, target))
    app = create_app(state)
    log.info("serving %s on http://%s:%d (domains: %s; default %s; admin API %s)", state.model_name,
             settings.host, settings.port, ", ".join(state.domains), state.default_domain,
             "on" if settings.admin_token else "off")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=10)
    return 0


def add_serve_args(p, kit) -> None:
    kit.add_target_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default: %(default)s)")
    p.add_argument("--policy", default="scheduled", choices=POLICIES,
                   help="verify lengths: scheduled (load-aware, SPS(B)), fixed (whole block), none (no speculation)")
    p.add_argument("--shadow-fraction", type=float, default=0.05,
                   help="share of rounds that verify the whole drafted block (uncensored trace labels)")
    p.add_argument("--poll-interval", type=float, default=30.0,
                   help="seconds between registry alias polls, 0 = off (default: %(default)s)")
    p.add_argument("--domains", help="comma-separated domains to serve (default: every domain in the registry "
                                     "or --drafter-dir, plus the default domain)")
    p.add_argument("--default-domain", default="chat", help="domain for requests that name none (default: %(default)s)")
    p.add_argument("--alias", default="champion", help="registry alias each domain loads (default: %(default)s)")
    p.add_argument("--drafter-dir", help="local drafters instead of the registry: <dir>/<domain>/ or "
                                         "<dir>/dspark-<domain>/ with a checkpoint (+ calibration.json, sps.json)")
    p.add_argument("--no-registry", action="store_true", help="do not use the MLflow registry")
    p.add_argument("--sps", help="SPS(B) profile JSON for the scheduled policy (default: the drafter's registered "
                                 "sps.json, else a short start-up profile)")
    p.add_argument("--no-live-gate", action="store_true",
                   help="scheduled policy: never fall back to plain decoding steps when live throughput favours them")
    p.add_argument("--no-length-gate", action="store_true",
                   help="live gate: speculate with the scheduler's verify lengths only, never measuring them "
                        "against verifying every drafted token")
    p.add_argument("--gate-hurdle", type=float, default=ServeSettings.gate_hurdle,
                   help="live gate: with more than one row, speculate only when measured faster than plain steps by "
                        "this fraction (covers the desynchronised batch's drain the step timing misses; "
                        "default: %(default)s)")
    p.add_argument("--gate-explore-budget", type=float, default=ServeSettings.gate_explore_budget,
                   help="live gate: the share of time its comparisons of speculation against plain steps may lose; "
                        "a comparison that cost more is followed by a longer wait before the next (0 = no limit; "
                        "default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the target's)")
    p.add_argument("--max-tokens-default", type=int, default=256, help="chat max_tokens when a request gives none")
    p.add_argument("--canary-rounds", type=int, default=64, help="rounds before the canary compares acceptance")
    p.add_argument("--canary-ratio", type=float, default=0.7,
                   help="roll back when the new drafter's acceptance < ratio x the previous one's")
    p.add_argument("--acceptance-window", type=int, default=512, help="rounds in the live-acceptance window")
    p.add_argument("--max-draft-tokens", type=int, default=None, help="cap on draft tokens per round (like vLLM's "
                   "num_speculative_tokens; default: each drafter's trained block size)")
    p.add_argument("--prompt-lookup", action="store_true", help="prompt lookup in front of each domain's drafter: "
                   "where the last tokens repeat earlier text, draft the copy; elsewhere the drafter drafts")
    p.add_argument("--no-live-calibration", action="store_true", help="never refit calibration from served rounds "
                   "(every domain keeps its drafter's shipped calibration)")
    p.add_argument("--live-calibration-off", metavar="DOMAINS", help="domains whose live calibrator starts "
                   "disabled, e.g. code,math (POST /admin/calibration/{domain} turns it on)")
    p.add_argument("--live-window", type=int, default=ServeSettings.live_window,
                   help="fully verified rounds the live calibrator keeps per domain (default: %(default)s)")
    p.add_argument("--live-refit-every", type=int, default=ServeSettings.live_refit_every,
                   help="new rounds between live refits; refits that bring nothing new stretch it (default: "
                   "%(default)s)")
    p.add_argument("--live-max-backoff", type=int, default=ServeSettings.live_max_backoff,
                   help="refits that bring nothing new stretch the interval up to this many times "
                   "--live-refit-every; a refit that beats the calibration in use resets it (1 = never stretch; "
                   "default: %(default)s)")
    p.add_argument("--live-request-prior", type=float, default=ServeSettings.live_request_prior,
                   help="> 0: each request's drafts are sized with its own confidence offset, learned from its "
                   "earlier rounds and shrunk toward the live calibration by this many pseudo-labels (10 measured "
                   "best in replays; 0 = none; off with the live calibrator; default: %(default)s)")
    p.add_argument("--live-min-rounds", type=int, default=ServeSettings.live_min_rounds,
                   help="rounds a live refit needs; fewer keep the calibration in use (default: %(default)s)")
    p.add_argument("--memory-trim-interval", type=float, default=ServeSettings.memory_trim_interval,
                   help="seconds between handing freed heap memory back to the system (glibc malloc_trim, between "
                        "engine steps; 0 = never; default: %(default)s)")
    p.add_argument("--no-traces", action="store_true", help="do not write trace records")
    p.add_argument("--trace-buffer", type=int, default=4096, help="queued trace records before drops")
    p.add_argument("--trace-rotate-mb", type=float, default=64.0, help="rotate a trace file past this size")
    p.add_argument("--served-model-name", help="model id in the API (default: the target's name)")
    p.add_argument("--max-request-mb", type=float, default=ServeSettings.max_request_bytes / 2**20,
                   help="request bodies above this are refused with a 413 (default: %(default)s)")
    p.add_argument("--max-queued", type=int, default=ServeSettings.max_queued,
                   help="requests waiting for a batch slot before new ones get a 429 with Retry-After "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_commands(sub, kit) -> None:
    """Entry point: add ``dspark serve`` (``kit``: the entry point's CommandKit, read back as ``args.kit``)."""
    p = sub.add_parser("serve", help="OpenAI-compatible DSpark server with per-domain drafters, hot-swap, "
                                     "canary rollback, metrics and traces")
    add_serve_args(p, kit)
    p.set_defaults(func=cmd_serve, kit=kit)
