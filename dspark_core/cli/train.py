"""``dspark train`` and ``dspark eval``: drafter training and held-out evaluation from landed traces."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dspark_core.cli.common import (CliError, Settings, add_target_args, load_examples, load_target_from_args, log,
                                    table)


def parse_domains(text: str) -> list[str]:
    from dspark_core.data.prompts import DOMAINS
    domains = list(DOMAINS) if text in ("all", "") else [d.strip() for d in text.split(",") if d.strip()]
    return domains


def build_model_for_training(args, target, examples):
    """A fresh drafter (optionally with a trimmed vocabulary) or a warm start from ``--init``."""
    from dspark_core.pipeline.steps import build_model
    try:
        return build_model(target, examples, args.drafter, args.preset, args.block_size, args.draft_vocab,
                           args.seed, Path(args.init) if args.init else None)
    except ValueError as e:
        if args.init and "warm start" in str(e):
            raise CliError(f"--init {args.init}: {e}") from None
        raise


GENERIC_ANCHORS, FINE_TUNE_ANCHORS = 32, 64    # pipeline.Budget's anchors / domain_anchors (not imported:
                                                # the CLI starts without torch)


def _recipe_init(recipe, cfg, target):
    """The checkpoint a recipe fine-tune starts from, refused unless it holds the recipe's drafter (kind,
    Markov rank, block size, draft vocabulary size): `dspark train --recipe NAME` made it."""
    from dspark_core.drafters import load_drafter
    try:
        model = load_drafter(Path(recipe.init), target.runner, target.fingerprint)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(f"--init {recipe.init}: {e}", "pass the best/ folder of a dspark train --recipe run") from None
    got = {k: getattr(model.cfg, k) for k in ("kind", *recipe.drafter)}
    want = {"kind": cfg.kind, **{k: getattr(cfg, k) for k in recipe.drafter}}
    if got != want:
        diff = ", ".join(f"{k} {got[k]} (recipe: {want[k]})" for k in want if got[k] != want[k])
        raise CliError(f"--init {recipe.init} is not a {recipe.name} recipe drafter: {diff}",
                       f"fine-tune the best/ folder of: dspark train --recipe {recipe.name}")
    return model


def cmd_train_recipe(args, settings: Settings) -> int:
    """``dspark train --recipe NAME``: one leg of a recipe run (training/recipe.py)."""
    from dspark_core.drafters import build_drafter, drafter_config
    from dspark_core.pipeline.steps import in_vocab, stored_features
    from dspark_core.training.recipe import BEST, get_recipe, run_recipe
    from dspark_core.training.train import top_token_vocab
    try:
        recipe = get_recipe(args.recipe)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.drafter != recipe.kind:
        raise CliError(f"recipe {recipe.name} trains a {recipe.kind} drafter, not {args.drafter}",
                       f"drop --drafter, or pass --drafter {recipe.kind}")
    if args.init:
        recipe = recipe.fine_tune(Path(args.init).resolve())
    if args.steps is not None:
        recipe = replace(recipe, max_steps=args.steps)
    if args.leg_minutes <= 0:
        raise CliError(f"--leg-minutes must be positive, got {args.leg_minutes}")
    domains = parse_domains(args.domain)
    target = load_target_from_args(args, settings)
    examples, _ = load_examples(settings.home, domains, "train", target.fingerprint)
    examples = in_vocab(examples, target.runner.arch.vocab_size)
    heldout = {}
    for d in domains:
        try:
            heldout[d] = load_examples(settings.home, [d], "heldout", target.fingerprint)[0]
        except CliError:
            pass
    if not heldout:
        raise CliError(f"no held-out traces for {','.join(domains)}: a recipe scores held-out tau to know when to stop",
                       "run: dspark traces bootstrap (it keeps a held-out split of each domain)")
    tag = "all" if args.domain in ("all", "") else args.domain.replace(",", "+")
    out = (Path(args.out) if args.out else
           settings.home / "drafters" / f"{recipe.name}-{tag}{'-tuned' if recipe.init else ''}")
    cfg = drafter_config(recipe.kind, target.runner.arch, **recipe.drafter)
    if recipe.init:
        model = _recipe_init(recipe, cfg, target)
    else:
        model = build_drafter(cfg, target.runner, seed=recipe.seed)
        if model.head.trimmed:
            model.head.set_vocab(top_token_vocab(examples, model.head.size, cfg.vocab_size, target.stop_token_ids))
    log(f"recipe {recipe.name}: {recipe.kind} {recipe.drafter}, loss {recipe.loss}, on {len(examples)} "
        f"{'+'.join(domains)} sequences, held-out {sum(len(v) for v in heldout.values())}; scored every "
        f"{recipe.eval_every} steps, up to {recipe.max_steps}; this leg at most {args.leg_minutes:g} min -> {out}")
    try:
        state = run_recipe(target, model, examples, heldout, out, recipe, leg_minutes=args.leg_minutes,
                           features=stored_features(target, model, settings.home), resume=not args.no_resume,
                           progress=not args.json, extra_meta={"domains": domains, "examples": len(examples)},
                           log=log)
    except ValueError as e:
        raise CliError(str(e), "pass --out DIR for a new run, or --no-resume to start this one over") from None
    best = state.best or {}
    summary = {"recipe": recipe.name, "status": state.status, "checkpoint": str(out / BEST), "folder": str(out),
               "steps": state.scores[-1]["step"] if state.scores else 0, "best_step": best.get("step"),
               "tau_greedy": best.get("tau_greedy"), "tau_expected": best.get("tau_expected"),
               "heldout": best.get("domains"), "legs": state.legs, "train_seconds": state.train_seconds,
               "scores": [{k: x[k] for k in ("step", "tau_greedy", "tau_expected")} for x in state.scores]}
    if args.json:
        print(json.dumps(summary))
    else:
        print(table([("recipe", recipe.name), ("status", state.status), ("steps", summary["steps"]),
                     ("best step", summary["best_step"]), ("held-out tau, greedy", summary["tau_greedy"]),
                     ("held-out tau, T = 1", summary["tau_expected"]), ("legs", state.legs),
                     ("training seconds", state.train_seconds), ("checkpoint", summary["checkpoint"])], header=False))
    if state.status == "leg-ended":
        log("the leg's time is up; run the same command again to go on from the last score")
    return 0


def cmd_train(args, settings: Settings) -> int:
    if args.recipe:
        return cmd_train_recipe(args, settings)
    from dspark_core.training.losses import LossConfig
    from dspark_core.pipeline.steps import stored_features, train_domain
    from dspark_core.training.train import TrainConfig
    if args.drafter not in ("dspark", "dflash", "eagle3"):
        raise CliError(f"cannot train drafter {args.drafter!r}", "choose dspark, dflash or eagle3")
    if args.anchors is not None and args.anchors < 1:
        raise CliError(f"--anchors must be at least 1, got {args.anchors}", "the default is 32, 64 with --init")
    anchors = args.anchors or (FINE_TUNE_ANCHORS if args.init else GENERIC_ANCHORS)
    domains = parse_domains(args.domain)
    target = load_target_from_args(args, settings)
    examples, _ = load_examples(settings.home, domains, "train", target.fingerprint)
    model = build_model_for_training(args, target, examples)
    tag = "all" if args.domain in ("all", "") else args.domain.replace(",", "+")
    out = Path(args.out) if args.out else settings.home / "drafters" / f"{args.drafter}-{tag}"
    autocast = False if args.no_autocast else (True if args.autocast else None)     # None: where bf16 is native
    steps = 300 if args.steps is None else args.steps
    cfg = TrainConfig(steps=steps, batch_size=args.batch_size, anchors_per_seq=anchors, lr=args.lr,
                      max_seq_len=args.max_seq_len, seed=args.seed, checkpoint_every=args.checkpoint_every,
                      autocast_bf16=autocast, loss=LossConfig.preset(args.drafter))
    out.mkdir(parents=True, exist_ok=True)
    metrics_file = (out / "metrics.jsonl").open("a")

    def callback(step: int, metrics: dict) -> None:
        metrics_file.write(json.dumps(metrics) + "\n")
        metrics_file.flush()

    log(f"training {args.drafter} on {len(examples)} {'+'.join(domains)} sequences "
         f"({'warm start from ' + args.init if args.init else 'fresh'}), {steps} steps x {anchors} anchors "
         f"-> {out}")
    # features that `dspark traces bootstrap --features` stored as it generated the traces are read, not recomputed
    features = stored_features(target, model, settings.home)
    try:
        res = train_domain(target, examples, out, cfg, args.drafter, model, callback, resume=not args.no_resume,
                           progress=not args.json, features=features,
                           extra_meta={"domains": domains, "examples": len(examples), "init": args.init})
    finally:
        metrics_file.close()
    if features is not None:
        log(f"target features: {features.loaded} sequences read from {features.store.root}, "
             f"{features.computed} computed")
    ran = json.loads((out / "config.json").read_text()).get("train", {})      # what the run resolved
    summary = {"checkpoint": str(out), "drafter": args.drafter, "domains": domains, "examples": len(examples),
               "steps": res.steps, "seconds": round(res.seconds, 1), "final": res.final,
               "autocast_bf16": ran.get("autocast_bf16"),
               "features": {"loaded": features.loaded if features else 0,
                            "computed": features.computed if features else None}}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(table([("drafter", args.drafter), ("domains", domains), ("examples", len(examples)),
                 ("steps", res.steps), ("seconds", summary["seconds"]),
                 ("precision", "bf16 autocast" if summary["autocast_bf16"] else "fp32"),
                 ("loss", res.final.get("loss")), ("teacher-forced tau", res.final.get("tau_expected")),
                 ("target features", summary["features"]), ("checkpoint", str(out))], header=False))
    return 0


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter against the frozen target from landed traces",
                       description="Train a drafter against the frozen target from landed traces (progress on "
                       "stderr). Prints a summary: drafter, domains, examples, steps, seconds, precision, final "
                       "loss and teacher-forced tau, target features read, checkpoint folder; --json prints it as "
                       "one JSON object.")
    add_target_args(p, dtype="auto")
    p.add_argument("--drafter", default="dspark", help="dspark, dflash or eagle3 (default: %(default)s)")
    p.add_argument("--domain", default="all", help="all, or comma-separated domains (default: %(default)s)")
    p.add_argument("--init", help="warm-start from this checkpoint (per-domain fine-tuning); with --recipe, a "
                   "recipe run's best/ folder, fine-tuned on --domain by the recipe's fine-tune schedule")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps (default: 300; with --recipe, the recipe's most, where a plateau "
                   "usually stops it sooner)")
    p.add_argument("--recipe", help="train a named recipe (reference: the configuration the scaling suite found "
                   "best) for as long as held-out tau keeps rising, in legs of --leg-minutes; rerun to go on")
    p.add_argument("--leg-minutes", type=float, default=85.0,
                   help="with --recipe: no new stretch of training starts after this (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: %(default)s)")
    p.add_argument("--anchors", type=int, default=None,
                   help=f"blocks sampled per sequence (default: {GENERIC_ANCHORS}; {FINE_TUNE_ANCHORS} with --init, "
                   "as the pipeline's per-domain fine-tunes)")
    p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the preset's 7)")
    p.add_argument("--draft-vocab", type=int, default=None, help="trim the draft vocabulary to the N most "
                   "frequent target tokens in the traces (cuts the draft LM-head cost)")
    p.add_argument("--preset", default="default", help="drafter size preset: default or tiny")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--out", help="checkpoint folder (default: $DSPARK_HOME/drafters/<drafter>-<domain>)")
    p.add_argument("--no-resume", action="store_true", help="start over even if the folder has a train state")
    ac = p.add_mutually_exclusive_group()
    ac.add_argument("--no-autocast", action="store_true", help="train in fp32 (default: bf16 autocast where bf16 "
                    "matmuls are native: CUDA, CPUs with AVX512-BF16 or AMX; fp32 elsewhere)")
    ac.add_argument("--autocast", action="store_true", help="bf16 autocast even where bf16 is emulated")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object (no progress bar)")
    p.set_defaults(func=cmd_train)


def _against(specs: list[str], drafter: str) -> dict[str, tuple[str, Path | None]]:
    """``--against KIND[=CKPT]`` entries by name: the kind, or ``KIND@FOLDER`` where a kind repeats."""
    from dspark_core.drafters import PROPOSER_KINDS
    out: dict[str, tuple[str, Path | None]] = {}
    for spec in specs:
        kind, _, ckpt = spec.partition("=")
        if kind not in PROPOSER_KINDS or kind == "none":
            raise CliError(f"--against {spec}: unknown drafter kind {kind!r}",
                           f"use one of {', '.join(k for k in PROPOSER_KINDS if k != 'none')}, e.g. --against ngram "
                           f"or --against dspark=.dspark/drafters/NAME/best")
        if kind == drafter and not ckpt:
            raise CliError(f"--against {spec} is the evaluated drafter's kind without a checkpoint",
                           f"name the other checkpoint: --against {kind}=DIR")
        if ckpt and not Path(ckpt).is_dir():
            raise CliError(f"--against {spec}: no checkpoint folder at {ckpt}", "give a drafter checkpoint folder")
        name = kind if kind != drafter and kind not in out else f"{kind}@{Path(ckpt).parent.name or ckpt}"
        if name in out or name == drafter:
            raise CliError(f"--against {spec} names the same drafter twice", "give each --against once")
        out[name] = (kind, Path(ckpt) if ckpt else None)
    return out


def _fmt_range(r: dict | list | None) -> str:
    if r is None:
        return ""
    lo, hi = (r["low"], r["high"]) if isinstance(r, dict) else r
    return f"{lo:.3f}-{hi:.3f}"


def cmd_eval(args, settings: Settings) -> int:
    from dspark_core.pipeline.steps import EvalConfig, compare_drafters
    against = _against(args.against or [], args.drafter)
    target = load_target_from_args(args, settings)
    _, records = load_examples(settings.home, [args.domain], "heldout", target.fingerprint)
    prompts = [list(r.prompt_ids) for r in (records if args.prompts == 0 else records[:args.prompts])]
    if not prompts:
        raise CliError(f"no held-out {args.domain} prompts for this target",
                       f"land some: dspark traces bootstrap --domains {args.domain}")
    report = {"domain": args.domain, "drafter": args.drafter, "checkpoint": args.checkpoint,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "results": {}}
    for t in [float(x) for x in args.temperatures.split(",")]:
        cfg = EvalConfig(args.max_new_tokens, t, args.block_size, args.seed, kind=args.drafter, reps=args.reps)
        report["results"][f"T={t:g}"] = compare_drafters(
            target, Path(args.checkpoint) if args.checkpoint else None, prompts, cfg, against,
            log=None if args.json else log).to_dict()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = []
    for r in report["results"].values():
        for name, d, vs in [(args.drafter, r, None), *((k, v, v["versus"]) for k, v in r["against"].items())]:
            rows.append({"domain": args.domain, "drafter": name, "temperature": r["temperature"], "tau": d["tau"],
                         "speedup": d["speedup"], "speedup 5-95%": _fmt_range(d.get("speedup_range")),
                         "tok/s": d["tok_s"], "plain tok/s": r["plain_tok_s"],
                         f"{args.drafter} ÷ it: tau": "" if vs is None else
                         f"{vs['tau_ratio']['value']:.3f} ({_fmt_range(vs['tau_ratio'])})",
                         "speed": "" if vs is None else
                         f"{vs['speed_ratio']['value']:.3f} ({_fmt_range(vs['speed_ratio'])})",
                         "acceptance per position": d["acceptance_per_position"]})
    print(table(rows))
    print(f"ranges: 5-95 % over paired resamples of the {len(prompts)} prompts")
    return 0


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="held-out tau, acceptance per position and speedup of a drafter",
                       description="Evaluate a drafter on held-out prompts next to the plain engine (and any "
                       "--against drafters), interleaved prompt by prompt. Prints a row per drafter and "
                       "temperature: tau, speedup with its range, tok/s (drafter and plain), the ratios to each "
                       "--against drafter with ranges, acceptance per position; --json prints the full report.")
    add_target_args(p, dtype="auto")
    p.add_argument("--drafter", default="dspark")
    p.add_argument("--checkpoint", help="drafter checkpoint folder")
    p.add_argument("--reps", type=int, default=1, help="timed passes over the prompts, rotated order, per-prompt "
                   "medians (default: %(default)s; 3 on a noisy machine)")
    p.add_argument("--domain", required=True, help="chat, code or math")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts to use, 0 for all of them "
                   "(default: %(default)s)")
    p.add_argument("--against", action="append", metavar="KIND[=CKPT]",
                   help="repeatable: also measure this drafter in the same interleaved run and report the evaluated "
                        "one ÷ it (tau, speed) with 5-95 %% ranges over paired resamples of the prompts, e.g. "
                        "--against ngram, --against dspark-lookup (the evaluated checkpoint behind prompt lookup), "
                        "--against dspark=OTHER_CKPT")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.set_defaults(func=cmd_eval)
