"""``dspark calibrate`` (STS refit from fully verified rounds) and ``dspark profile-sps``."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_core.cli.common import (CliError, Settings, add_target_args, load_examples, load_target_from_args, log,
                                    table)


def cmd_calibrate(args, settings: Settings) -> int:
    from dspark_core.pipeline.steps import calibrate_drafter
    target = load_target_from_args(args, settings)
    _, records = load_examples(settings.home, [args.domain], "heldout", target.fingerprint)
    prompts = [list(r.prompt_ids) for r in records[:args.prompts]]
    out = Path(args.out or Path(args.checkpoint) / f"calibration-{args.domain}.json")
    try:
        summary = calibrate_drafter(target, Path(args.checkpoint), prompts, out, args.max_new_tokens,
                                    args.temperature, args.min_rounds, args.seed)
    except ValueError as e:
        if "fully verified rounds" in str(e):
            raise CliError(str(e).split(";")[0], "calibration needs a DSpark drafter (it has a confidence head)")
        raise
    if summary.fallback:
        log(f"STS refit skipped: {summary.rounds} fully verified rounds < {args.min_rounds}; kept the "
             f"previous or identity calibration")
    if args.json:
        print(json.dumps({k: v for k, v in summary.to_dict().items() if k in (
            "calibration", "rounds", "temperatures", "fallback", "ece_raw", "ece_calibrated", "auroc")}, indent=2))
        return 0
    print(table([{"position": i + 1, "ece raw": r, "ece calibrated": c, "auroc": a, "temperature": t}
                 for i, (r, c, a, t) in enumerate(zip(summary.ece_raw, summary.ece_calibrated, summary.auroc,
                                                      summary.temperatures))]))
    print(f"{summary.rounds} fully verified rounds; calibration: {summary.calibration}"
          + (" (previous or identity kept)" if summary.fallback else ""))
    return 0


def cmd_profile_sps(args, settings: Settings) -> int:
    from dspark_core.pipeline.steps import SPSConfig, profile_drafter
    target = load_target_from_args(args, settings)
    dtype = str(target.runner.dtype).replace("torch.", "")
    suffix = f"-r{args.rows}" if args.rows else ""
    out = Path(args.out or settings.home / "sps" / f"sps-{target.runner.device.type}-{dtype}{suffix}.json")
    cfg = SPSConfig(args.max_tokens, args.reps, args.context, kind=args.drafter, rows=args.rows)
    res = profile_drafter(target, Path(args.checkpoint) if args.checkpoint else None, out, cfg,
                          log=None if args.json else log)
    if args.json:
        print(json.dumps({"sps": res.sps, "plot": res.plot, "table": res.table}))
        return 0
    print(table([{"b": b, "steps/s": sps} for b, sps in enumerate(res.table, 1)]))
    print(f"wrote {res.sps} and {res.plot}")
    return 0


def add_calib_parsers(sub) -> None:
    p = sub.add_parser("calibrate", help="fit Sequential Temperature Scaling on fully verified held-out rounds",
                       description="Fit Sequential Temperature Scaling on fully verified held-out rounds and write "
                       "the calibration JSON. Prints a row per draft position (ECE before and after, AUROC, "
                       "temperature), then the rounds used and the file; --json prints them as JSON.")
    add_target_args(p, dtype="auto")
    p.add_argument("--checkpoint", required=True, help="DSpark drafter checkpoint folder")
    p.add_argument("--domain", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--min-rounds", type=int, default=200, help="fewer rounds keep the previous calibration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="calibration JSON (default: <checkpoint>/calibration-<domain>.json)")
    p.add_argument("--json", action="store_true", help="print the fit as JSON")
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("profile-sps", help="measure SPS(B), engine steps/s per verify batch of B tokens",
                       description="Measure SPS(B), engine steps/s per verify batch of B tokens, and write it "
                       "(JSON and plot). Prints a row per B, then the files; --json prints the paths and table.")
    add_target_args(p, dtype="auto")
    p.add_argument("--drafter", default="dspark")
    p.add_argument("--checkpoint")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=None, help="profile at this concurrency (default: fewest rows)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", help="JSON path (default: $DSPARK_HOME/sps/sps-<device>-<dtype>.json)")
    p.add_argument("--json", action="store_true", help="print the paths and the SPS table as JSON")
    p.set_defaults(func=cmd_profile_sps)
