"""The ``dspark`` command line. The only place in dspark_core that reads argv and the environment.

Verbs of the other packages (registry, flows, serving) plug in through the ``dspark.commands`` entry
point group, so this core module never imports them.
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import entry_points
from pathlib import Path

from dspark_core.cli.bench import add_bench_parser, target_loader
from dspark_core.cli.calib import add_calib_parsers
from dspark_core.cli.common import KIT, CliError, Settings, add_target_args, load_target_from_args, log as _log, table
from dspark_core.cli.interop import add_interop_parsers
from dspark_core.cli.train import add_eval_parser, add_train_parser

# Each verb imports what only it needs inside its function: `dspark --help` and the registry and flow
# verbs start without loading the drafters, the training loop or the benchmarks.


# --------------------------------------------------------------------------- target
def cmd_target_prepare(args, settings: Settings) -> int:
    from dspark_core.model.target import prepare_local, prepare_smollm2
    if args.model:
        out = prepare_local(Path(args.model), settings.home, name=args.name, force=args.force, log=_log)
    else:
        out = prepare_smollm2(settings.home, force=args.force, log=_log)
    manifest = json.loads((out / "dspark_target.json").read_text())
    print(json.dumps({"target": out.name, "path": str(out), **manifest}) if args.json
          else f"{out.name}: fingerprint {manifest['fingerprint']} ({out})")
    return 0


# ------------------------------------------------------------------------- generate
def _read_prompts(args) -> list[str]:
    if bool(args.prompt is not None) == bool(args.prompts):
        raise CliError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompts)
    if not path.exists():
        raise CliError(f"prompts file {path} does not exist")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CliError(f"{path}:{lineno}: not valid JSON ({e.msg})", 'each line must be {"prompt": "..."}')
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise CliError(f"{path}:{lineno}: missing string field 'prompt'", 'each line must be {"prompt": "..."}')
        prompts.append(rec["prompt"])
    if not prompts:
        raise CliError(f"{path} holds no prompts")
    return prompts


def cmd_generate(args, settings: Settings) -> int:
    from dspark_core.engine.decode_one import generate
    from dspark_core.engine.inputs import encode_prompt, make_generator
    from dspark_core.drafters import PROPOSER_KINDS, build_proposer
    from dspark_core.engine.sampling import SamplingParams

    if args.drafter not in PROPOSER_KINDS:
        raise CliError(f"unknown drafter {args.drafter!r}", f"choose one of {', '.join(PROPOSER_KINDS)}")
    prompts = _read_prompts(args)
    for i, p in enumerate(prompts):
        if not p.strip():
            raise CliError(f"prompt {i} is empty", "give some text to continue")
    target = load_target_from_args(args, settings)
    proposer = build_proposer(args.drafter, target.runner, target.fingerprint,
                              Path(args.checkpoint) if args.checkpoint else None, args.block_size, args.seed)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens,
                            stop_token_ids=() if args.ignore_eos else target.stop_token_ids)
    for i, text in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, text, args.chat)
        gen = make_generator(args.seed + i, args.device)
        res = generate(target.runner, ids, params, proposer, args.block_size, gen)
        out_text = target.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"index": i, "token_ids": res.token_ids, "text": out_text,
                              "finish_reason": res.finish_reason, "stats": res.stats.to_dict()}), flush=True)
        else:
            s = res.stats
            print(out_text)
            _log(f"[{args.drafter}] {len(res.token_ids)} tokens in {s.wall_seconds:.2f} s "
                 f"({len(res.token_ids) / max(s.wall_seconds, 1e-9):.1f} tok/s), tau {s.tau:.2f}, "
                 f"accepted {s.accepted}/{s.verified}")
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with or without speculation",
                       description="Generate a continuation of each prompt. Prints the text (the timing and tau "
                       "line goes to stderr); --json prints one JSON object per prompt.")
    add_target_args(p)
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--prompts", help='JSONL file, one {"prompt": "..."} per line')
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--drafter", default="dspark", help="none, ngram, dspark, dflash or eagle3 (default: %(default)s)")
    p.add_argument("--checkpoint", help="drafter checkpoint folder (default: a seeded fresh initialisation)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per round (default: the drafter's)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    p.set_defaults(func=cmd_generate)


# --------------------------------------------------------------------------- traces
def _domains_arg(args) -> list[str]:
    from dspark_core.data.prompts import DOMAINS
    from dspark_core.data.traces import is_domain_name
    text = args.domain if args.domain is not None else args.domains
    domains = [d.strip() for d in text.split(",") if d.strip()]
    if not domains:
        raise CliError("--domains is empty", f"choose from {','.join(DOMAINS)}, or name your own with --prompts FILE")
    bad = [d for d in domains if not is_domain_name(d)]
    if bad:
        raise CliError(f"domain {bad[0]!r} is not a lowercase name of [a-z0-9_-]", "e.g. --domain support")
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown and args.prompts is None:
        raise CliError(f"domain {unknown[0]!r} has no built-in prompts",
                       f"give it your prompts with --prompts FILE, or choose from {','.join(DOMAINS)}")
    return domains


def cmd_traces_bootstrap(args, settings: Settings) -> int:
    from dspark_core.data.bootstrap import BootstrapConfig, bootstrap_traces
    from dspark_core.data.features import training_taps
    from dspark_core.data.prompts import DOMAINS, PromptFileError
    domains = _domains_arg(args)
    chosen = [f for f, v in (("--code-from", args.code_from), ("--prompts", args.prompts),
                             ("--from-sharegpt", args.from_sharegpt or None)) if v is not None]
    if len(chosen) > 1:
        raise CliError(f"choose one prompt source, not {' and '.join(chosen)}")
    if args.from_sharegpt and any(d not in DOMAINS for d in domains):
        raise CliError("--from-sharegpt routes ShareGPT turns to chat, code and math only",
                       "use --prompts FILE for a domain of your own")
    if args.heldout and not args.from_sharegpt:
        raise CliError("--heldout lands the held-out conversations' ShareGPT turns", "add --from-sharegpt")
    if args.heldout and args.train_only:
        raise CliError("--heldout and --train-only exclude each other", "drop one of them")
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise CliError(f"--prompts {args.prompts}: no such file",
                       "JSONL of prompts, OpenAI chat messages or ShareGPT conversations")
    if args.code_from is not None:
        if domains != ["code"]:
            raise CliError("--code-from mines prompts for the code domain only", "add --domains code")
        from dspark_core.data.prompts import code_source_root
        try:
            code_source_root(args.code_from)
        except FileNotFoundError as exc:
            raise CliError(str(exc), "--code-from stdlib mines the standard library of this Python")
    target = load_target_from_args(args, settings)
    cfg = BootstrapConfig(tuple(domains), per_domain=args.per_domain, seed=args.seed, batch_size=args.batch_size,
                          max_new_tokens=args.max_new_tokens, heldout_fraction=args.heldout_fraction,
                          sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
                          samples_per_prompt=args.samples_per_prompt, train_only=args.train_only,
                          code_from=args.code_from, prompts_file=args.prompts, from_sharegpt=args.from_sharegpt,
                          heldout_only=args.heldout,
                          feature_taps=training_taps(target.runner.arch) if args.features else None)
    try:
        summary = bootstrap_traces(target, settings.home, cfg, progress=not args.json, log=_log)
    except PromptFileError as exc:
        raise CliError(str(exc), "one prompt per line: a JSON string, {\"prompt\": ...}, {\"messages\": [...]} "
                       "or {\"conversations\": [...]}")
    if args.json:
        print(json.dumps({"target": target.name, "fingerprint": target.fingerprint, "domains": summary}, indent=2))
        return 0
    cols = ("domain", "prompts", "new", "skipped", "tokens", "tokens_per_s", "train", "heldout", "file")
    print(table([{"domain": domain, **row} for domain, row in summary.items()], cols))
    return 0


def cmd_traces_import(args, settings: Settings) -> int:
    from dspark_core.data.chatlogs import import_chat_logs
    from dspark_core.data.prompts import PromptFileError
    from dspark_core.data.traces import TraceFormatError, is_domain_name
    if not is_domain_name(args.domain):
        raise CliError(f"domain {args.domain!r} is not a lowercase name of [a-z0-9_-]", "e.g. --domain support")
    if not Path(args.file).is_file():
        raise CliError(f"{args.file}: no such file", "give a chat-log file (JSON lines or a JSON array)")
    if not (args.temperature >= 0 and 0 < args.top_p <= 1 and args.top_k >= 0 and args.max_new_tokens >= 1):
        raise CliError("the sampling is out of range", "--temperature >= 0, 0 < --top-p <= 1, --top-k >= 0, "
                       "--max-new-tokens >= 1")
    if not 0 <= args.heldout_fraction < 1:
        raise CliError(f"--heldout-fraction {args.heldout_fraction} is out of range", "give a value in [0, 1)")
    target = load_target_from_args(args, settings)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "max_new_tokens": args.max_new_tokens}
    try:
        summary = import_chat_logs(target, settings.home, Path(args.file), args.domain, sampling,
                                   args.heldout_fraction, args.seed, log=_log)
    except (PromptFileError, TraceFormatError, ValueError) as exc:
        raise CliError(str(exc), "each record needs a user message and, last, the model's reply")
    if args.json:
        print(json.dumps({"target": target.name, "fingerprint": target.fingerprint, "domain": args.domain,
                          **summary}, indent=2))
        return 0
    print(f"{args.domain}: {summary['new']} new, {summary['skipped']} already there, {summary['rejected']} "
          f"rejected, {summary['tokens']} reply tokens, {summary['train']} train / {summary['heldout']} held-out "
          f"prompts -> {summary['file']}")
    return 0


def add_traces_parser(sub) -> None:
    from dspark_core.data.bootstrap import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS, SERVING_SAMPLING
    tp = sub.add_parser("traces", help="build and inspect trace files")
    tsub = tp.add_subparsers(dest="action", metavar="ACTION")
    tsub.required = True
    p = tsub.add_parser("bootstrap", help="run the target on ShareGPT / HumanEval / math prompts, or on your own "
                        "prompts, and land traces (resumable, deterministic for a seed)",
                        description="Run the target on ShareGPT / HumanEval / math prompts, or on a prompt file of "
                        "your own for any domain (--domain NAME --prompts FILE), and land the traces. "
                        "Prints a table per domain (prompts, new, skipped, tokens, tok/s, train, heldout, file); "
                        "--json prints the same as JSON.")
    add_target_args(p, dtype="auto")
    p.add_argument("--domains", default="chat,code,math", help="comma-separated (default: %(default)s)")
    p.add_argument("--domain", help="one domain, built-in or your own (a new one needs --prompts)")
    p.add_argument("--per-domain", type=int, default=None,
                   help="prompts per domain (default: 64 from the built-in sources, all of --prompts or "
                        "--from-sharegpt)")
    p.add_argument("--prompts", metavar="FILE",
                   help="your prompts: JSON lines (or one JSON array) of strings, {\"prompt\": ...}, OpenAI chat "
                        "{\"messages\": [...]} or ShareGPT {\"conversations\": [...]}; a conversation gives one "
                        "prompt per user turn. Bad records are reported and skipped")
    p.add_argument("--from-sharegpt", action="store_true",
                   help="extra training data: every ShareGPT human turn the prompt classifier routes to the "
                        "domain (chat, code or math); conversations whose first turn is held-out chat are left "
                        "out, and the run is training-only")
    p.add_argument("--heldout", action="store_true",
                   help="with --from-sharegpt: instead, the routed turns of the held-out conversations, landed "
                        "as the domain's held-out prompts (never trained on), so evaluation has more prompts")
    p.add_argument("--seed", type=int, default=0, help="prompt order, math problems, split and sampling seed")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help="rows generated together (default: %(default)s)")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="completions per training prompt (held-out prompts keep one; default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="share of prompts held out per domain (default: %(default)s)")
    p.add_argument("--train-only", action="store_true",
                   help="only training prompts (extra data, e.g. greedy completions with --temperature 0)")
    p.add_argument("--code-from", metavar="stdlib|PATH",
                   help="code only: instead of HumanEval, docstring-completion prompts mined from local Python "
                        "source (public documented functions; 'stdlib' = this Python's standard library, or your "
                        "repository's folder); always training-only, so evaluation stays on held-out HumanEval")
    p.add_argument("--temperature", type=float, default=SERVING_SAMPLING["temperature"],
                   help="0 = greedy; each setting lands in its own file (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=SERVING_SAMPLING["top_p"])
    p.add_argument("--top-k", type=int, default=SERVING_SAMPLING["top_k"])
    p.add_argument("--features", action="store_true",
                   help="also store the target features of the training sequences as they are generated "
                        "(DSPARK_HOME/features; `dspark train` then reads them instead of running the target)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table (no progress bar)")
    p.set_defaults(func=cmd_traces_bootstrap)

    p = tsub.add_parser("import", help="land existing chat logs (replies the target already wrote) as traces",
                        description="Land existing chat logs as traces of a domain, without running the target: "
                        "each record's last message is the reply the target served (OpenAI chat messages, ShareGPT "
                        "conversations, or {\"prompt\", \"completion\"}; JSON lines or one JSON array). "
                        "Idempotent; bad records are reported and skipped. Prints one summary line; --json the "
                        "summary as JSON.")
    add_target_args(p, dtype="auto")
    p.add_argument("file", metavar="FILE", help="the chat-log file")
    p.add_argument("--domain", required=True, help="the domain the traces land in (built-in or your own)")
    p.add_argument("--temperature", type=float, default=SERVING_SAMPLING["temperature"],
                   help="the sampling the logged replies were served with (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=SERVING_SAMPLING["top_p"])
    p.add_argument("--top-k", type=int, default=SERVING_SAMPLING["top_k"])
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="the reply budget they were served with (raised per record to the reply's length)")
    p.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="share of prompts held out, for a domain without a recorded split (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="split seed, for a domain without a recorded split")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_traces_import)


# ----------------------------------------------------------------------------- demo
def cmd_demo(args, settings: Settings) -> int:
    from dspark_core.bench.engine import demo
    return demo(target_loader(args, settings), settings.home, args.max_new_tokens, log=_log)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding: engine, drafters, "
                                     "calibration, registry, flows and serving.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True

    tp = sub.add_parser("target", help="prepare or register the frozen target model")
    tsub = tp.add_subparsers(dest="action", metavar="ACTION")
    tsub.required = True
    prep = tsub.add_parser("prepare", help="dequantise the packaged SmolLM2 (or register --model PATH) into DSPARK_HOME",
                           description="Dequantise the packaged SmolLM2 (or register --model PATH) into "
                           "DSPARK_HOME. Prints one line: name, fingerprint and folder; --json prints the manifest.")
    prep.add_argument("--model", help="a local HF Llama/Qwen2/Qwen3 checkpoint folder")
    prep.add_argument("--name", help="name to register --model under (default: the folder name)")
    prep.add_argument("--force", action="store_true", help="redo even if already prepared")
    prep.add_argument("--json", action="store_true", help="print the target's manifest as JSON")
    prep.set_defaults(func=cmd_target_prepare)

    add_generate_parser(sub)
    add_bench_parser(sub)
    add_traces_parser(sub)
    demo = sub.add_parser("demo", help="prepare the target and compare plain vs speculative generation",
                          description="Prepare the target, generate with and without speculation and print both "
                          "texts with their timings.")
    add_target_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.set_defaults(func=cmd_demo)

    add_train_parser(sub)
    add_eval_parser(sub)
    add_calib_parsers(sub)
    add_interop_parsers(sub)

    for ep in entry_points(group="dspark.commands"):
        try:
            ep.load()(sub, KIT)
        except ImportError as e:  # a plugin whose optional dependencies are missing stays out of the way
            _log(f"note: command plugin {ep.name} unavailable ({e})")
    return parser


def main(argv: list[str] | None = None) -> int:
    from dspark_core.model.target import TargetError
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    verb = " ".join(v for v in (args.verb, getattr(args, "action", None)) if v)      # e.g. "registry show"
    try:
        return args.func(args, settings)
    except CliError as e:
        _log(f"error: {e}\nhint: {e.hint or f'see: dspark {verb} --help'}")
        return 2
    except (ValueError, FileNotFoundError, TargetError) as e:
        hint = "run: dspark target prepare" if isinstance(e, TargetError) else f"see: dspark {verb} --help"
        _log(f"error: {e}\nhint: {hint}")
        return 2

