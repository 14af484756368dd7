"""``dspark calibrate`` (STS refit from fully verified rounds) and ``dspark profile-sps``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .cli import CliError, Settings, add_target_args, load_target_from_args


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def collect_rounds(runner, proposer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   stop_ids: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Run held-out prompts with full-block verification; return conf logits [N, G] and accepted [N]."""
    from .decode import generate
    from .sampling import SamplingParams
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    confs, accepted = [], []
    G = proposer.max_block
    for i, ids in enumerate(prompts):
        res = generate(runner, ids, params, proposer, generator=torch.Generator().manual_seed(seed + i),
                       record_rounds=True)
        for rd in res.stats.round_log:
            c = rd["confidence_logits"]
            if c is not None and rd["full_verify"] and len(c) == G:
                confs.append(c)
                accepted.append(rd["accepted"])
    if not confs:
        raise CliError("no fully verified rounds with confidences were collected",
                       "calibration needs a DSpark drafter (it has a confidence head)")
    return torch.tensor(confs), torch.tensor(accepted)


def cmd_calibrate(args, settings: Settings) -> int:
    from .calibration import Calibration, fit_sts, reliability_plot
    from .cli_train import load_examples
    from .proposers import build_proposer
    target = load_target_from_args(args, settings)
    prop = build_proposer("dspark", target.runner, target.fingerprint, Path(args.checkpoint))
    _, records = load_examples(settings.home, [args.domain], "heldout", target.fingerprint)
    prompts = [list(r.prompt_ids) for r in records[:args.prompts]]
    conf, acc = collect_rounds(target.runner, prop, prompts, args.max_new_tokens, args.temperature,
                               target.stop_token_ids, args.seed)
    out = Path(args.out or Path(args.checkpoint) / f"calibration-{args.domain}.json")
    previous = Calibration.from_dict(json.loads(out.read_text())) if out.exists() else None
    cal = fit_sts(conf, acc, min_rounds=args.min_rounds, previous=previous)
    cal.drafter, cal.target_fingerprint = str(args.checkpoint), target.fingerprint
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cal.to_dict(), indent=2))
    reliability_plot(conf, acc, cal, out.with_suffix(".png"))
    summary = {"calibration": str(out), "rounds": cal.rounds, "temperatures": cal.temperatures,
               "fallback": cal.fallback, "ece_raw": [m["ece"] for m in cal.raw],
               "ece_calibrated": [m["ece"] for m in cal.calibrated], "auroc": [m["auroc"] for m in cal.raw]}
    print(json.dumps(summary, indent=2) if args.json else
          "\n".join(f"position {m['position']}: ECE {m['ece']:.4f} -> {c['ece']:.4f}, AUROC {m['auroc']:.3f}, "
                    f"T = {t}" for m, c, t in zip(cal.raw, cal.calibrated, cal.temperatures)))
    return 0


def cmd_profile_sps(args, settings: Settings) -> int:
    from .proposers import build_proposer
    from .sps import profile_sps, save_sps
    target = load_target_from_args(args, settings)
    prop = build_proposer(args.drafter, target.runner, target.fingerprint,
                          Path(args.checkpoint) if args.checkpoint else None)
    block = prop.max_block if prop is not None else 7
    prof = profile_sps(target.runner, prop, args.max_tokens, args.reps, args.context, block,
                       log=None if args.json else _log, rows=args.rows)
    prof["target_fingerprint"] = target.fingerprint
    dtype = str(target.runner.dtype).replace("torch.", "")
    suffix = f"-r{args.rows}" if args.rows else ""
    out = Path(args.out or settings.home / "sps" / f"sps-{target.runner.device.type}-{dtype}{suffix}.json")
    save_sps(prof, out)
    print(json.dumps({"sps": str(out), "plot": str(out.with_suffix(".png")), "table": prof["sps"]})
          if args.json else f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def add_calib_parsers(sub) -> None:
    p = sub.add_parser("calibrate", help="fit Sequential Temperature Scaling on fully verified held-out rounds")
    add_target_args(p, dtype="auto")
    p.add_argument("--checkpoint", required=True, help="DSpark drafter checkpoint folder")
    p.add_argument("--domain", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--min-rounds", type=int, default=200, help="fewer rounds keep the previous calibration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="calibration JSON (default: <checkpoint>/calibration-<domain>.json)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("profile-sps", help="measure SPS(B), engine steps/s per verify batch of B tokens")
    add_target_args(p, dtype="auto")
    p.add_argument("--drafter", default="dspark")
    p.add_argument("--checkpoint")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=None, help="profile at this concurrency (default: fewest rows)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", help="JSON path (default: $DSPARK_HOME/sps/sps-<device>-<dtype>.json)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile_sps)
