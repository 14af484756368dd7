"""``dspark warehouse ...`` and ``dspark registry ...``: plugged into the core CLI through the
``dspark.commands`` entry point group (the core never imports registry).

Each verb prints a table for a person by default and JSON with ``--json``; the table printer, the
one-line error and the log come from the entry point's CommandKit, read back as ``args.kit``."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegistrySettings:
    """Embedded defaults under DSPARK_HOME; each can be pointed elsewhere by its own variable."""

    home: Path
    tracking_uri: str
    artifact_location: str
    warehouse: Path
    landing: Path | str             # a local folder, or an s3:// URL (kept as a string: Path would mangle it)

    @classmethod
    def from_env(cls) -> "RegistrySettings":
        home = Path(os.environ.get("DSPARK_HOME", "./.dspark")).expanduser().resolve()
        return cls(home=home,
                   tracking_uri=os.environ.get("DSPARK_MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}"),
                   artifact_location=os.environ.get("DSPARK_MLFLOW_ARTIFACTS", str(home / "mlartifacts")),
                   warehouse=Path(os.environ.get("DSPARK_WAREHOUSE", home / "traces.duckdb")),
                   landing=_landing(os.environ.get("DSPARK_LANDING", str(home / "landing"))))


def _landing(value: str) -> Path | str:
    return value if value.startswith("s3://") else Path(value)


def _plain(obj):
    """A registry or warehouse result as JSON-ready data: its ``to_dict()``, a dataclass's fields, or itself."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return obj


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _registry():
    from .mlflow_registry import DrafterRegistry
    s = RegistrySettings.from_env()
    return DrafterRegistry(s.tracking_uri, s.artifact_location)


# ------------------------------------------------------------------------------------ warehouse
def _open_warehouse(args, path: Path, **kw):
    """The warehouse, or the CLI's one-line error (exit code 2) when it is locked or missing."""
    from .warehouse import TraceWarehouse
    try:
        return TraceWarehouse(path, **kw)
    except RuntimeError as e:
        raise args.kit.error(str(e), "wait for the other process (an ingest, a flow or a server) to finish") from None
    except FileNotFoundError as e:
        raise args.kit.error(str(e), "land traces, then run: dspark warehouse ingest") from None


def cmd_ingest(args, _settings) -> int:
    from .warehouse import S3Settings, target_vocab_sizes
    s = RegistrySettings.from_env()
    with _open_warehouse(args, Path(args.db or s.warehouse), s3=S3Settings.from_env(os.environ),
                         vocab_sizes=target_vocab_sizes(Path(s.home) / "targets")) as wh:
        summary = wh.ingest_landing(args.landing or s.landing)
        out = summary.to_dict()
        out["warehouse_total"] = wh.count()
    if args.json:
        _print_json(out)
    else:
        print(args.kit.table([out]))
    return 0


def cmd_stats(args, _settings) -> int:
    s = RegistrySettings.from_env()
    with _open_warehouse(args, Path(args.db or s.warehouse), read_only=True) as wh:
        out = {"records": wh.count(), "by_domain": {d: wh.count(d) for d in wh.domains()},
               "acceptance": {d: _plain(wh.live_acceptance(d)) for d in wh.domains()},
               "totals": _plain(wh.totals()),
               "quarantine": wh.quarantine_rows(limit=args.quarantine)}
    if args.json:
        _print_json(out)
        return 0
    table, t = args.kit.table, out["totals"]
    if out["acceptance"]:
        cols = ("domain", "records", "rounds", "drafted", "verified", "accepted", "acceptance", "tau")
        print(table(out["acceptance"].values(), cols))
    else:
        print("no traces in the warehouse")
    print(f"\ningested: {t['records']} records read, {t['stored']} stored, {t['quarantined']} quarantined, "
          f"{t['duplicates']} duplicates; tables: {t['trace_rows']} traces, {t['quarantine_rows']} quarantined lines")
    if out["quarantine"]:
        print(f"\nquarantine (first {len(out['quarantine'])}):")
        print(table([_quarantined(q) for q in out["quarantine"]]))
    return 0


def _quarantined(row: dict) -> dict:
    """A quarantine row for the table: the reason without its ``file:line:`` prefix (both have columns),
    the raw line cut short."""
    where = f"{row['source_file']}:{row['line']}: "
    reason = row["reason"][len(where):] if str(row["reason"]).startswith(where) else row["reason"]
    raw = row["raw"] if len(str(row["raw"])) <= 40 else str(row["raw"])[:37] + "..."
    return {"source_file": row["source_file"], "line": row["line"], "reason": reason, "raw": raw,
            "ingested_at": row["ingested_at"]}


# ------------------------------------------------------------------------------------- registry
def cmd_list(args, _settings) -> int:
    reg = _registry()
    out = {}
    for d in ([args.domain] if args.domain else reg.domains()):
        champ = reg.champion(d)
        out[d] = {"versions": [asdict(v) for v in reg.versions(d)], "champion": champ.version if champ else None}
    if args.json:
        _print_json(out)
        return 0
    rows = [{"domain": d, "version": v["version"], "champion": "yes" if v["version"] == o["champion"] else "",
             "run_id": v["run_id"], "model_uri": v["model_uri"]} for d, o in out.items() for v in o["versions"]]
    print(args.kit.table(rows) if rows else
          f"no registered drafters{' for ' + repr(args.domain) if args.domain else ''}")
    return 0


def _created(ms) -> str:
    """MLflow's creation time (epoch milliseconds) as ISO 8601 UTC."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(ms) / 1000))
    except (TypeError, ValueError):
        return str(ms)


def cmd_show(args, _settings) -> int:
    from .mlflow_registry import RegistryError
    reg = _registry()
    if args.version is not None:
        try:
            info = _plain(reg.version_info(args.domain, args.version))
        except RegistryError as e:
            raise args.kit.error(str(e), f"list the registered versions: dspark registry list --domain {args.domain}")
    else:
        champ = reg.champion(args.domain)
        if champ is None:
            versions = [v.version for v in reg.versions(args.domain)]
            if not versions:
                raise args.kit.error(f"no drafter is registered for domain {args.domain!r}",
                                     "list the registered domains: dspark registry list")
            raise args.kit.error(f"domain {args.domain!r} has no champion",
                                 f"show a version (registered: {', '.join(f'v{v}' for v in versions)}): "
                                 f"dspark registry show {args.domain} VERSION, or promote one: "
                                 f"dspark registry promote {args.domain} VERSION")
        info = _plain(reg.version_info(args.domain, champ.version))
    if args.json:
        _print_json(info)
        return 0
    table = args.kit.table
    print(table([("name", info["name"]), ("version", info["version"]), ("aliases", info["aliases"] or None),
                 ("run id", info["run_id"]), ("model uri", info["model_uri"]),
                 ("created", _created(info["created"]))], header=False))
    for title, section in (("metric", info["metrics"]), ("param", info["params"]), ("tag", info["tags"])):
        if section:
            print()
            print(table(sorted(section.items()), (title, "value")))
    return 0


def cmd_promote(args, _settings) -> int:
    rec = asdict(_registry().promote(args.domain, args.version, args.reason or "manual promotion"))
    if args.json:
        _print_json(rec)
    else:
        was = f"v{rec['previous_champion']}" if rec["previous_champion"] is not None else "none"
        print(f"{rec['domain']}: champion is v{rec['version']} (was {was}); reason: {rec['reason']}")
    return 0


def cmd_rollback(args, _settings) -> int:
    out = {"domain": args.domain, "champion": _registry().rollback(args.domain, args.reason or "manual rollback")}
    if args.json:
        _print_json(out)
    else:
        print(f"{out['domain']}: champion rolled back to v{out['champion']}")
    return 0


def cmd_export(args, settings) -> int:
    """A registered version in an engine's format: the export registered with it when there is one, else
    exported now from its checkpoint against the prepared target."""
    import shutil
    import tempfile

    from dspark_core.formats import FormatError, export_drafter

    from .mlflow_registry import RegistryError
    which = args.version if args.version is not None else args.alias
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise args.kit.error(f"--out {out} exists and is not empty", "give a new folder")
    with tempfile.TemporaryDirectory(prefix="dspark-registry-export-") as tmp:
        try:
            got = _registry().download(args.domain, which, Path(tmp) / "version")
        except RegistryError as e:
            raise args.kit.error(str(e), f"list the versions: dspark registry list --domain {args.domain}")
        version = json.loads((got / "registry.json").read_text())["version"]
        registered = got / args.format
        if registered.is_dir():
            shutil.copytree(registered, out, dirs_exist_ok=True)
            source = "registered export"
            if args.verifier:
                cfg_path = out / "config.json"
                config = json.loads(cfg_path.read_text())
                config.setdefault("speculators_config", {}).setdefault("verifier", {})["name_or_path"] = args.verifier
                cfg_path.write_text(json.dumps(config, indent=2))
        else:
            target = args.kit.load_target(args, settings)
            try:
                export_drafter(got / "checkpoint", target, args.format, out, verifier=args.verifier)
            except (FormatError, ValueError) as e:
                raise args.kit.error(str(e), "only drafters in the reference layout export; retrain with the "
                                     "current defaults") from None
            source = "exported from the checkpoint"
    row = {"domain": args.domain, "version": version, "format": args.format, "out": str(out), "source": source}
    if args.json:
        _print_json(row)
    else:
        print(args.kit.table([row]))
    return 0


def add_commands(sub, kit) -> None:
    """Entry point: add the warehouse and registry verbs to the dspark parser. ``kit`` is the entry point's
    CommandKit; the verbs read it back as ``args.kit`` (its ``table`` prints their records, its ``error``
    is the CLI's one-line error with a hint)."""
    wp = sub.add_parser("warehouse", help="the DuckDB trace warehouse (ingest landing files, stats)")
    wsub = wp.add_subparsers(dest="action", metavar="ACTION")
    wsub.required = True
    p = wsub.add_parser("ingest", help="ingest landing JSONL/Parquet files (idempotent, quarantines bad lines)",
                        description="Ingest the landing JSONL/Parquet files into the warehouse (idempotent; bad "
                        "lines go to quarantine). Prints one row: files, skipped files, lines read, stored, "
                        "quarantined, duplicates and the warehouse's trace count.")
    p.add_argument("--landing", help="landing folder or s3://bucket/prefix (default: $DSPARK_LANDING, "
                   "else $DSPARK_HOME/landing)")
    p.add_argument("--db", help="DuckDB file (default: $DSPARK_HOME/traces.duckdb)")
    p.add_argument("--json", action="store_true", help="print the counts as JSON")
    p.set_defaults(func=cmd_ingest, kit=kit)
    p = wsub.add_parser("stats", help="counts, live acceptance per domain, quarantine",
                        description="Print a row per domain (traces, speculative rounds, drafted / verified / "
                        "accepted tokens, acceptance, tau), the warehouse totals and the first quarantined lines.")
    p.add_argument("--db", help="DuckDB file (default: $DSPARK_HOME/traces.duckdb)")
    p.add_argument("--quarantine", type=int, default=10, help="quarantine rows to show (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=cmd_stats, kit=kit)

    rp = sub.add_parser("registry", help="MLflow drafter registry: list, show, promote, rollback, export")
    rsub = rp.add_subparsers(dest="action", metavar="ACTION")
    rsub.required = True
    p = rsub.add_parser("list", help="registered drafter versions per domain",
                        description="Print a row per registered version: domain, version, whether it is the "
                        "champion, MLflow run and model URI.")
    p.add_argument("--domain", help="only this domain")
    p.add_argument("--json", action="store_true", help="print {domain: {versions, champion}} as JSON")
    p.set_defaults(func=cmd_list, kit=kit)
    p = rsub.add_parser("show", help="one version: aliases, metrics, params, tags (default: the champion)",
                        description="Print one registered version: name, aliases, run, model URI and creation "
                        "time, then its metrics, params and tags. Without VERSION: the domain's champion.")
    p.add_argument("domain")
    p.add_argument("version", type=int, nargs="?", help="version number (default: the champion)")
    p.add_argument("--json", action="store_true", help="print the version as JSON")
    p.set_defaults(func=cmd_show, kit=kit)
    p = rsub.add_parser("promote", help="make VERSION the domain's champion",
                        description="Move the domain's champion alias to VERSION (the previous champion is "
                        "recorded for rollback). Prints one confirmation line.")
    p.add_argument("domain")
    p.add_argument("version", type=int)
    p.add_argument("--reason", default="", help="recorded on the version (default: manual promotion)")
    p.add_argument("--json", action="store_true", help="print the promotion record as JSON")
    p.set_defaults(func=cmd_promote, kit=kit)
    p = rsub.add_parser("rollback", help="move the champion back to the previous one",
                        description="Move the domain's champion back to the version it replaced. Prints one "
                        "confirmation line.")
    p.add_argument("domain")
    p.add_argument("--reason", default="", help="recorded on the demoted version")
    p.add_argument("--json", action="store_true", help="print {domain, champion} as JSON")
    p.set_defaults(func=cmd_rollback, kit=kit)
    p = rsub.add_parser("export", help="write a registered drafter as a speculators or DeepSpec folder",
                        description="Write a registered version (default: the champion) as a folder vLLM and "
                        "SGLang load: the export registered with it, else one made now from its checkpoint "
                        "against the prepared target. Prints one row.")
    kit.add_target_args(p)
    p.add_argument("domain")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--alias", default="champion", help="registered alias (default: %(default)s)")
    which.add_argument("--version", type=int, help="version number")
    p.add_argument("--format", required=True, choices=["speculators", "deepspec"])
    p.add_argument("--out", required=True, help="folder to write (new or empty)")
    p.add_argument("--verifier", help="the target's hub id or path on the serving hosts (default: as registered)")
    p.add_argument("--json", action="store_true", help="print the row as JSON")
    p.set_defaults(func=cmd_export, kit=kit)
