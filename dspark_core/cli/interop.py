"""``dspark export`` and ``dspark import``: drafters in the serving engines' formats (speculators, DeepSpec)."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_core.cli.common import CliError, Settings, add_target_args, load_target_from_args, log, table


def cmd_export(args, settings: Settings) -> int:
    from dspark_core.formats import FormatError, export_drafter
    target = load_target_from_args(args, settings)
    try:
        out = export_drafter(Path(args.checkpoint), target, args.format, Path(args.out), verifier=args.verifier)
    except FormatError as e:
        raise CliError(str(e), "dspark export works on dspark and dflash drafters in the reference layout") from None
    config = json.loads((out / "config.json").read_text())
    row = {"format": args.format, "out": str(out),
           "verifier": config.get("speculators_config", {}).get("verifier", {}).get("name_or_path", "(embedded)"),
           "target layers": config.get("aux_hidden_state_layer_ids", config.get("target_layer_ids"))}
    print(json.dumps(row) if args.json else table([row]))
    return 0


def cmd_import(args, settings: Settings) -> int:
    from dspark_core.formats import FormatError, import_drafter
    target = load_target_from_args(args, settings)
    try:
        report = import_drafter(Path(args.folder), target, Path(args.out))
    except FormatError as e:
        raise CliError(str(e), "dspark import reads speculators DSpark/DFlash and DeepSpec Qwen3DSparkModel "
                       "folders") from None
    if report.target_check == "shapes only":
        log("note: the folder carries no fingerprint, LM head or embedding to check the target against; "
            "only shapes were checked")
    print(json.dumps(report.to_dict()) if args.json else table([report.to_dict()]))
    return 0


def add_interop_parsers(sub) -> None:
    p = sub.add_parser("export", help="write a drafter as a speculators or DeepSpec folder (vLLM, SGLang load it)",
                       description="Write a drafter checkpoint as a folder vLLM and SGLang load as is: "
                       "--format speculators (config.json with speculators' fields, the verifier named by path) or "
                       "--format deepspec (DeepSpec's Qwen3DSparkModel). Only drafters in the reference layout "
                       "map exactly; others are refused with the field that differs. Prints one row.")
    add_target_args(p)
    p.add_argument("checkpoint", help="dspark drafter checkpoint folder")
    p.add_argument("--format", required=True, choices=["speculators", "deepspec"])
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--verifier", help="the target's hub id or path on the serving hosts (default: its folder here)")
    p.add_argument("--json", action="store_true", help="print the row as JSON")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", help="read a speculators or DeepSpec drafter folder into a dspark checkpoint",
                       description="Read a speculators DSpark/DFlash or DeepSpec Qwen3DSparkModel folder into a "
                       "dspark drafter checkpoint for the prepared target (checked by the fingerprint an export "
                       "recorded, else the LM-head and embedding rows). Fine-tune it with dspark train --init. "
                       "Prints one row: format, kind, checkpoint, weights read, how the target was checked.")
    add_target_args(p)
    p.add_argument("folder", help="the speculators or DeepSpec folder")
    p.add_argument("--out", required=True, help="dspark checkpoint folder to write")
    p.add_argument("--json", action="store_true", help="print the row as JSON")
    p.set_defaults(func=cmd_import)
