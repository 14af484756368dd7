"""``dspark bench``: pick a suite, run it, write its JSON, print its table."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

from dspark_core.cli.common import CliError, Settings, add_target_args, log as _log


def cmd_bench(args, settings: Settings) -> int:
    # the suites load lazily: each pulls in its own stack (training, HTTP client, HF reference model)
    from dspark_core.bench import batch as bench_batch, bootstrap as bench_bootstrap, device as bench_device
    from dspark_core.bench import drafters as bench_drafters, engine as bench, load as bench_load
    suites = {"engine": bench.engine_suite, "drafters": bench_drafters.drafters_suite, "load": bench_load.load_suite,
              "batch": bench_batch.batch_suite, "bootstrap": bench_bootstrap.bootstrap_suite,
              "device": bench_device.device_suite}
    plugins = {ep.name: ep for ep in entry_points(group="dspark.bench_suites")}   # e.g. serve (serving/)
    if args.suite not in suites and args.suite not in plugins:
        raise CliError(f"unknown bench suite {args.suite!r}", f"choose one of {', '.join([*suites, *plugins])}")
    suite = suites.get(args.suite) or plugins[args.suite].load()
    result = suite(args, settings, log=_log)
    out_dir = Path(args.out or settings.home / "bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.suite}.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render = {"drafters": bench_drafters.render_markdown, "load": bench_load.render_markdown,
                  "batch": bench_batch.render_markdown, "bootstrap": bench_bootstrap.render_markdown}.get(
            args.suite, bench.render_markdown)
        print((getattr(suite, "render", None) or render)(result))      # a plugin suite may bring its own
    _log(f"wrote {out_dir / (args.suite + '.json')}")
    return 0


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks (medians and ratios)")
    add_target_args(p, dtype="auto")
    p.add_argument("--suite", default="engine", help="engine, drafters, load, batch, bootstrap, device (accelerator check: "
                   "--device cuda), or a plugin suite such as serve (default: %(default)s)")
    p.add_argument("--against", metavar="REV", help="batch and bootstrap suites: also run the engine of this git revision "
                   "(e.g. HEAD~3), interleaved in the same process, and report paired ratios")
    p.add_argument("--checkpoint", help="load suite: the DSpark checkpoint (default: the drafters bench's generic)")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer prompts and repetitions")
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    p.add_argument("--sched", action="store_true", help="drafters suite: also calibrate and evaluate dspark-sched, "
                   "the scheduler at batch 1 (always on with --quick)")
    p.add_argument("--code-mined", type=int, default=None, metavar="N",
                   help="drafters suite: also train the code drafters on greedy completions of N function stubs mined "
                        "from the standard library (dspark traces bootstrap --code-from stdlib; default: 0, --quick 8)")
    p.add_argument("--max-new-tokens", type=int, default=None)
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
    p.add_argument("--out", help="output folder (default: $DSPARK_HOME/bench)")
    p.add_argument("--json", action="store_true", help="print the JSON result")
    p.set_defaults(func=cmd_bench)


