"""``dspark warehouse ...`` and ``dspark registry ...``: plugged into the core CLI through the
``dspark.commands`` entry point group (the core never imports registry)."""

from __future__ import annotations

import json
import os
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


def _print(obj, as_json: bool) -> None:
    print(json.dumps(obj, indent=2, default=str) if as_json else "\n".join(f"{k}: {v}" for k, v in obj.items()))


def cmd_ingest(args, _settings) -> int:
    from .warehouse import S3Settings, TraceWarehouse
    s = RegistrySettings.from_env()
    with TraceWarehouse(Path(args.db or s.warehouse), s3=S3Settings.from_env(os.environ)) as wh:
        summary = wh.ingest_landing(args.landing or s.landing)
        out = summary.to_dict()
        out["warehouse_total"] = wh.count()
    _print(out, args.json)
    return 0


def cmd_stats(args, _settings) -> int:
    from .warehouse import TraceWarehouse
    s = RegistrySettings.from_env()
    with TraceWarehouse(Path(args.db or s.warehouse), read_only=True) as wh:
        out = {"records": wh.count(), "by_domain": {d: wh.count(d) for d in wh.domains()},
               "acceptance": {d: wh.live_acceptance(d) for d in wh.domains()}, "totals": wh.totals(),
               "quarantine": wh.quarantine_rows(limit=args.quarantine)}
    _print(out, args.json)
    return 0


def cmd_registry(args, _settings) -> int:
    from .mlflow_registry import DrafterRegistry
    s = RegistrySettings.from_env()
    reg = DrafterRegistry(s.tracking_uri, s.artifact_location)
    if args.action == "list":
        out = {}
        for d in ([args.domain] if args.domain else reg.domains()):
            champ = reg.champion(d)
            out[d] = {"versions": [asdict(v) for v in reg.versions(d)],
                      "champion": champ.version if champ else None}
    elif args.action == "promote":
        out = asdict(reg.promote(args.domain, args.version, args.reason or "manual promotion"))
    elif args.action == "rollback":
        out = {"domain": args.domain, "champion": reg.rollback(args.domain, args.reason or "manual rollback")}
    else:
        out = reg.version_info(args.domain, args.version)
    print(json.dumps(out, indent=2, default=str))
    return 0


def add_commands(sub, kit=None) -> None:
    """Entry point: add the warehouse and registry verbs to the dspark parser (``kit``: the entry point's
    CommandKit, unused here)."""
    wp = sub.add_parser("warehouse", help="the DuckDB trace warehouse (ingest landing files, stats)")
    wsub = wp.add_subparsers(dest="action", metavar="ACTION")
    wsub.required = True
    p = wsub.add_parser("ingest", help="ingest landing JSONL/Parquet files (idempotent, quarantines bad lines)")
    p.add_argument("--landing", help="landing folder or s3://bucket/prefix (default: $DSPARK_LANDING, "
                   "else $DSPARK_HOME/landing)")
    p.add_argument("--db", help="DuckDB file (default: $DSPARK_HOME/traces.duckdb)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ingest)
    p = wsub.add_parser("stats", help="counts, live acceptance per domain, quarantine")
    p.add_argument("--db")
    p.add_argument("--quarantine", type=int, default=10, help="quarantine rows to show")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)

    rp = sub.add_parser("registry", help="MLflow drafter registry: list, show, promote, rollback")
    rsub = rp.add_subparsers(dest="action", metavar="ACTION")
    rsub.required = True
    p = rsub.add_parser("list")
    p.add_argument("--domain")
    p.set_defaults(func=cmd_registry)
    for name in ("show", "promote"):
        p = rsub.add_parser(name)
        p.add_argument("domain")
        p.add_argument("version", type=int)
        p.add_argument("--reason", default="")
        p.set_defaults(func=cmd_registry)
    p = rsub.add_parser("rollback")
    p.add_argument("domain")
    p.add_argument("--reason", default="")
    p.set_defaults(func=cmd_registry)
