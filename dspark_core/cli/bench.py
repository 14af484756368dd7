"""``dspark bench``: check the options, build the suite's config, load the target, run the suite, write its
JSON (with the ``meta`` block) and print its table. ``dspark bench report`` renders docs/results.md and the
README's headline table from the committed result files.

The suites (:mod:`dspark_core.bench`) take a loaded target (or a loader) and a frozen config and never see
these arguments. Plugin suites (entry point group ``dspark.bench_suites``, e.g. ``serve`` from serving/)
are called ``suite(args, settings, kit)`` with the options already checked here and the
:class:`~dspark_core.cli.common.CommandKit`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import time
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from dspark_core.cli.common import KIT, CliError, Settings, add_target_args, load_target_from_args, log

# The bench modules are imported inside the functions that use them: each pulls in torch and its own
# stack (training, the HF reference model), which `dspark --help` and the other verbs must not load.

BUILTIN = ("engine", "drafters", "load", "batch", "bootstrap", "device", "scaling")
REPORT_OPTIONS = ("results", "doc", "readme")


# ----------------------------------------------------------------------------- checked options
def target_loader(args, settings: Settings):
    """A :class:`~dspark_core.bench.inputs.TargetLoader` for the target these options choose."""
    def load(dtype: str | None = None, keep_reference: bool = False):
        chosen = argparse.Namespace(**{**vars(args), "dtype": dtype or args.dtype})
        return load_target_from_args(chosen, settings, keep_reference=keep_reference)
    return load


def parse_levels(raw: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """``--concurrency 8,16`` (the levels to measure, ascending), or ``default``."""
    if not raw:
        return default
    try:
        levels = sorted({int(x) for x in str(raw).split(",") if x.strip()})
    except ValueError:
        raise CliError(f"--concurrency takes comma-separated integers such as 1,4,8,16, got {raw!r}",
                       "e.g. dspark bench --suite load --concurrency 8,16") from None
    if not levels or levels[0] < 1:
        raise CliError(f"--concurrency needs levels >= 1, such as 1,4,8,16, got {raw!r}",
                       "e.g. dspark bench --suite load --concurrency 8,16")
    return tuple(levels)


def parse_policies(raw: str | None, known: tuple[str, ...]) -> tuple[str, ...]:
    """``--policies none,scheduled``: the chosen policies in ``known``'s order, always with the baseline
    ``none`` (every ratio is taken against it)."""
    if not raw:
        return known
    want = {x.strip() for x in str(raw).split(",") if x.strip()}
    unknown = sorted(want - set(known))
    if unknown:
        raise CliError(f"--policies: unknown {', '.join(unknown)}; choose from {', '.join(known)}",
                       "e.g. dspark bench --suite load --policies scheduled")
    return tuple(p for p in known if p in want or p == "none")


def _check_common(args) -> None:
    """Checks that hold for every suite, plugins included, before anything is loaded."""
    if args.waves is not None and args.waves < 1:
        raise CliError(f"--waves must be >= 1, got {args.waves}", "requests per level = waves x concurrency")
    if args.code_mined is not None and args.code_mined < 0:
        raise CliError(f"--code-mined must be >= 0, got {args.code_mined}", "0 trains without mined stubs")
    if args.host_label is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,39}", args.host_label):
        raise CliError(f"--host-label must be lower-case letters, digits and dashes, got {args.host_label!r}",
                       "name the machine, e.g. --host-label amd-epyc")


# ----------------------------------------------------------------------------- one function per suite
def _run_engine(args, settings: Settings) -> dict:
    from dspark_core.bench.engine import EngineBenchConfig, engine_suite
    cfg = EngineBenchConfig.quick(args.device) if args.quick else EngineBenchConfig(device=args.device)
    cfg = replace(cfg, reps=args.reps or cfg.reps, max_new_tokens=args.max_new_tokens or cfg.max_new_tokens)
    return engine_suite(target_loader(args, settings), cfg, log=log)


def parse_reference_domains(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``--reference-domain DOMAIN=DIR`` (repeatable) as (domain, dir) pairs, one per domain."""
    out = {}
    for item in items:
        d, sep, ckpt = item.partition("=")
        if not sep or not d.strip() or not ckpt.strip():
            raise CliError(f"--reference-domain {item!r} is not DOMAIN=DIR",
                           "e.g. --reference-domain code=$DSPARK_HOME/drafters/reference-code-tuned/best")
        if d.strip() in out:
            raise CliError(f"--reference-domain names {d.strip()} twice", "give one checkpoint per domain")
        out[d.strip()] = ckpt.strip()
    return tuple(out.items())


def _run_drafters(args, settings: Settings) -> dict:
    from dspark_core.bench.drafters import DraftersBenchConfig, drafters_suite
    cfg = DraftersBenchConfig.quick() if args.quick else DraftersBenchConfig()
    if args.prompts is not None and args.prompts < 1:
        raise CliError(f"--prompts {args.prompts}: the drafters suite decodes at least one held-out prompt",
                       "e.g. --prompts 115 (land more held-out prompts: dspark traces bootstrap --from-sharegpt "
                       "--heldout)")
    cfg = replace(cfg, eval_max_new_tokens=args.max_new_tokens or cfg.eval_max_new_tokens,
                  eval_prompts=args.prompts or cfg.eval_prompts, eval_reps=args.reps or cfg.eval_reps,
                  scheduled=cfg.scheduled or args.sched,
                  code_mined=cfg.code_mined if args.code_mined is None else args.code_mined,
                  reference=args.reference, reference_domain=parse_reference_domains(args.reference_domain or []))
    if args.reference and not (Path(args.reference) / "config.json").exists():
        raise CliError(f"--reference {args.reference} holds no drafter checkpoint",
                       "pass the best/ folder of a dspark train --recipe run, e.g. $DSPARK_HOME/drafters/reference-all/best")
    for d, ckpt in cfg.reference_domain:
        if d not in cfg.domains:
            raise CliError(f"--reference-domain {d}={ckpt}: the drafters suite measures {', '.join(cfg.domains)}, "
                           f"not {d!r}", "e.g. --reference-domain code=$DSPARK_HOME/drafters/reference-code-tuned/best")
        if not (Path(ckpt) / "config.json").exists():
            raise CliError(f"--reference-domain {d}={ckpt} holds no drafter checkpoint",
                           "pass the best/ folder of dspark train --recipe NAME --domain D --init ...")
    return drafters_suite(load_target_from_args(args, settings), cfg, settings.home, log=log)


def _run_load(args, settings: Settings) -> dict:
    from dspark_core.bench.inputs import bench_checkpoint
    from dspark_core.bench.load import CONCURRENCY, POLICIES, WAVES, LoadBenchConfig, load_suite
    levels = parse_levels(args.concurrency, (1, 4) if args.quick else CONCURRENCY)
    policies = parse_policies(args.policies, POLICIES)
    ckpt = bench_checkpoint(settings.home, args.checkpoint)
    if args.quick:
        cfg = LoadBenchConfig.quick(ckpt, levels, policies)
    else:
        cfg = LoadBenchConfig(ckpt, levels, policies, waves=args.waves or WAVES, reps=max(1, args.reps or 4))
    cfg = replace(cfg, max_new_tokens=args.max_new_tokens or cfg.max_new_tokens)
    return load_suite(load_target_from_args(args, settings), cfg, settings.home, log=log)


def _run_batch(args, settings: Settings) -> dict:
    from dspark_core.bench.batch import BatchBenchConfig, batch_suite
    from dspark_core.bench.inputs import bench_checkpoint
    ckpt = bench_checkpoint(settings.home, args.checkpoint)
    cfg = BatchBenchConfig.quick(ckpt, args.against) if args.quick else BatchBenchConfig(ckpt, against=args.against)
    cfg = replace(cfg, reps=args.reps or cfg.reps, max_new_tokens=args.max_new_tokens or cfg.max_new_tokens)
    return batch_suite(load_target_from_args(args, settings), cfg, settings.home, log=log)


def _run_bootstrap(args, settings: Settings) -> dict:
    from dspark_core.bench.bootstrap import BootstrapBenchConfig, bootstrap_suite
    cfg = BootstrapBenchConfig.quick(args.against) if args.quick else BootstrapBenchConfig(against=args.against)
    cfg = replace(cfg, reps=args.reps or cfg.reps, max_new_tokens=args.max_new_tokens or cfg.max_new_tokens)
    return bootstrap_suite(load_target_from_args(args, settings), cfg, log=log)


def _run_device(args, settings: Settings) -> dict:
    from dspark_core.bench.device import DeviceBenchConfig, device_suite
    cfg = DeviceBenchConfig.quick(args.device) if args.quick else DeviceBenchConfig(device=args.device)
    cfg = replace(cfg, reps=args.reps or cfg.reps, max_new_tokens=args.max_new_tokens or cfg.max_new_tokens)
    return device_suite(target_loader(args, settings), cfg, log=log)


def _run_scaling(args, settings: Settings) -> dict:
    from dspark_core.bench.scaling import DOMAINS, ScalingConfig, scaling_suite
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        raise CliError(f"--budget-minutes must be > 0, got {args.budget_minutes}", "e.g. --budget-minutes 85")
    cfg = ScalingConfig.quick() if args.quick else ScalingConfig()
    if args.budget_minutes is not None:
        cfg = replace(cfg, budget_minutes=args.budget_minutes)
    if args.steps is not None:
        if args.steps < cfg.milestones:
            raise CliError(f"--steps must be at least {cfg.milestones} (one per scored milestone), got {args.steps}",
                           "e.g. --steps 2400")
        cfg = replace(cfg, steps=args.steps)
    if args.domains:
        names = tuple(dict.fromkeys(d.strip() for d in args.domains.split(",") if d.strip()))
        unknown = [d for d in names if d not in DOMAINS]
        if unknown or not names:
            raise CliError(f"--domains: unknown domain {', '.join(unknown) or '(none given)'}",
                           f"known domains: {', '.join(DOMAINS)}")
        cfg = replace(cfg, domains=names)
    if args.jobs:
        names = tuple(n.strip() for n in args.jobs.split(",") if n.strip())
        known = [j.name for j in cfg.jobs()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise CliError(f"--jobs: unknown job {', '.join(unknown) or '(none given)'}",
                           f"known jobs: {', '.join(known)}")
        cfg = replace(cfg, only=names)
    try:
        return scaling_suite(load_target_from_args(args, settings), cfg, settings.home, log=log)
    except ValueError as e:
        raise CliError(str(e), "dspark bench --suite drafters bootstraps the traces it needs") from None


def _run_vllm(args, settings: Settings) -> dict:
    from dspark_core.bench.vllm_cpu import VllmBenchConfig, vllm_suite
    cfg = VllmBenchConfig(checkpoint=args.checkpoint)
    if args.quick:
        cfg = replace(cfg, prompts=2, max_new_tokens=24, reps=1, concurrency=4)
    cfg = replace(cfg, reps=args.reps or cfg.reps, max_new_tokens=args.max_new_tokens or cfg.max_new_tokens)
    return vllm_suite(target_loader(args, settings), settings.home, cfg, log=log)


RUNNERS: dict[str, Callable[[argparse.Namespace, Settings], dict]] = {
    "engine": _run_engine, "drafters": _run_drafters, "load": _run_load, "batch": _run_batch,
    "bootstrap": _run_bootstrap, "device": _run_device, "vllm": _run_vllm, "scaling": _run_scaling}
BOTH_DTYPES = ("engine", "device")          # suites that measure float32 and bfloat16 whatever --dtype says


def _renderers() -> dict[str, Callable[[dict], str]]:
    from dspark_core.bench import batch, bootstrap, device, drafters, engine, load, scaling, vllm_cpu
    out = {"engine": engine.render_markdown, "drafters": drafters.render_markdown, "load": load.render_markdown,
           "batch": batch.render_markdown, "bootstrap": bootstrap.render_markdown, "device": device.render_markdown,
           "vllm": vllm_cpu.render_markdown, "scaling": scaling.render_markdown}
    for name, ep in _plugins().items():
        try:
            render = getattr(ep.load(), "render", None)
        except ImportError as e:        # a plugin whose optional dependencies are missing
            log(f"note: bench suite {name} unavailable ({e})")
            continue
        if render is not None:
            out[name] = render
    return out


def _plugins() -> dict:
    return {ep.name: ep for ep in entry_points(group="dspark.bench_suites")}


# ----------------------------------------------------------------------------- the verb
def command_line(args) -> str:
    """The ``dspark bench`` command these options spell: the suite, then every option not at its default."""
    defaults = vars(_options(argparse.ArgumentParser(add_help=False)).parse_args([]))
    parts = ["dspark", "bench", "--suite", args.suite]
    for dest, default in defaults.items():
        value = getattr(args, dest, default)
        if dest in ("suite", "action", *REPORT_OPTIONS) or value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        parts += [flag] if value is True else [flag, shlex.quote(str(value))]
    return " ".join(parts)


def _dtypes(args) -> tuple[str, ...]:
    if args.suite in BOTH_DTYPES:
        return ("float32", "bfloat16")
    from dspark_core.engine.inputs import resolve_dtype
    return (str(resolve_dtype(args.dtype, args.device)).replace("torch.", ""),)


def cmd_bench(args, settings: Settings) -> int:
    if args.action == "report":
        return cmd_report(args, settings)
    _check_common(args)
    plugins = _plugins()
    if args.suite not in RUNNERS and args.suite not in plugins:
        raise CliError(f"unknown bench suite {args.suite!r}", f"choose one of {', '.join([*RUNNERS, *plugins])}")
    from dspark_core.bench.record import results_dir, run_meta, with_meta, write_result
    t0 = time.perf_counter()
    if args.suite in RUNNERS:
        result = RUNNERS[args.suite](args, settings)
    else:
        result = plugins[args.suite].load()(args, settings, KIT)
    meta = run_meta(command_line(args), args.device, _dtypes(args), time.perf_counter() - t0, bool(args.quick))
    result = with_meta(result, meta)
    path = write_result(result, results_dir(settings.home, args.quick, args.out), args.host_label)
    if args.json:
        import json
        print(json.dumps(result, indent=2))
    else:
        print(_renderers().get(args.suite, str)(result))
    log(f"wrote {path}" + ("" if args.quick or args.out else "; `dspark bench report` renders docs/results.md"))
    return 0


def cmd_report(args, settings: Settings) -> int:
    from dspark_core.bench.record import repo_root
    from dspark_core.bench.report import write_report
    root = repo_root()
    results = Path(args.results) if args.results else (
        root / "benchmarks" / "results" if root else settings.home / "bench")
    doc = Path(args.doc) if args.doc else (root / "docs" / "results.md" if root else results / "results.md")
    readme = Path(args.readme) if args.readme else (root / "README.md" if root else None)
    for path in write_report(results, doc, _renderers(), readme):
        log(f"wrote {path}")
    return 0


def _options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_target_args(p, dtype="auto")
    p.add_argument("action", nargs="?", choices=("run", "report"), default="run",
                   help="run (default): run --suite and write its JSON, by default to benchmarks/results/<suite>.json "
                        "in a git checkout (quick runs and installed packages: $DSPARK_HOME/bench); report: "
                        "render docs/results.md and the README's headline table from the result files")
    p.add_argument("--suite", default="engine", help="engine, drafters, load, batch, bootstrap, device (accelerator check: "
                   "--device cuda), vllm (a dspark drafter served by vLLM-CPU: make interop-vllm), scaling (held-out "
                   "tau against data, steps and ablations; resumable legs), or a plugin suite such as serve or soak "
                   "(default: %(default)s)")
    p.add_argument("--against", metavar="REV", help="batch and bootstrap suites: also run the engine of this git revision "
                   "(e.g. HEAD~3), interleaved in the same process, and report paired ratios")
    p.add_argument("--checkpoint", help="load, batch and serve suites: the DSpark checkpoint (default: the drafters "
                   "bench's generic, or code for serve)")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer prompts and repetitions; written to "
                   "$DSPARK_HOME/bench, never over the committed results")
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    p.add_argument("--sched", action="store_true", help="drafters suite: also calibrate and evaluate dspark-sched, "
                   "the scheduler at batch 1 (always on with --quick)")
    p.add_argument("--code-mined", type=int, default=None, metavar="N",
                   help="drafters suite: also train the code drafters on greedy completions of N function stubs mined "
                        "from the standard library (dspark traces bootstrap --code-from stdlib; default: 0, --quick 8)")
    p.add_argument("--reference", metavar="DIR",
                   help="drafters suite: also evaluate this dspark train --recipe checkpoint (its best/ folder) as "
                   "dspark-reference, beside the equal-budget drafters")
    p.add_argument("--reference-domain", action="append", metavar="DOMAIN=DIR",
                   help="drafters suite (repeatable): also evaluate this per-domain fine-tune of the recipe drafter "
                   "(dspark train --recipe NAME --domain D --init .../best; its best/ folder) on its domain as "
                   "dspark-reference-domain")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--prompts", type=int, default=None, metavar="N",
                   help="drafters suite: held-out prompts decoded per domain (default: 8; ranges narrow about as "
                        "1/sqrt(N))")
    p.add_argument("--waves", type=int, default=None, help="load and serve suites: requests per concurrency level = "
                   "waves x concurrency (at least 8; default: load 6, serve 3)")
    p.add_argument("--concurrency", help="load suite: the concurrency levels to measure, e.g. 8 or 8,16 "
                   "(default: 1,4,8,16)")
    p.add_argument("--policies", help="load suite: the policies to run beside none, e.g. scheduled (default: "
                   "fixed,scheduled); fewer policies give more repetitions per minute to the ones that matter")
    p.add_argument("--block-size", type=int, default=None, help="serve suite: cap on draft tokens per round "
                   "(default: the drafter's trained block)")
    p.add_argument("--prompt-lookup", action="store_true", help="serve suite: the DSpark server puts prompt lookup "
                   "in front of its drafter (dspark serve --prompt-lookup)")
    p.add_argument("--budget-minutes", type=float, default=None, help="scaling suite: start no training run after "
                   "this many minutes (default: 85, --quick 10); rerun the same command to go on")
    p.add_argument("--steps", type=int, default=None, help="scaling suite: training steps of every run (default: "
                   "600); runs of another length are other content-keyed jobs, so both stay cached")
    p.add_argument("--domains", help="scaling suite: the domains whose traces train and score every run, e.g. code "
                   "(default: chat,code,math)")
    p.add_argument("--jobs", help="scaling suite: run only these jobs this leg, e.g. loss-ce,loss-tv (the rest "
                   "stay pending; default: all, in order)")
    p.add_argument("--out", help="output folder (default: benchmarks/results in a git checkout, else $DSPARK_HOME/bench)")
    p.add_argument("--host-label", metavar="LABEL",
                   help="write <suite>@LABEL.json instead of <suite>.json: the suite measured on another machine, "
                        "which `dspark bench report` renders as its own section beside the main one (e.g. amd-epyc)")
    p.add_argument("--json", action="store_true", help="print the JSON result (everything, also what the file leaves out)")
    report = p.add_argument_group("report (dspark bench report)")
    report.add_argument("--results", metavar="DIR", help="the result files to render (default: benchmarks/results)")
    report.add_argument("--doc", metavar="FILE", help="the page to write (default: docs/results.md)")
    report.add_argument("--readme", metavar="FILE", help="the README whose block between <!-- results:begin --> and "
                        "<!-- results:end --> gets the headline table (default: README.md, when it has the markers)")
    return p


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks (medians and ratios); `dspark bench report` renders "
                       "docs/results.md", description="Run a benchmark suite (`dspark bench --suite NAME`) or render "
                       "the results page (`dspark bench report`).")
    _options(p).set_defaults(func=cmd_bench)
