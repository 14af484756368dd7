"""``dspark bench --suite batch [--against REV]``: the batched engine under concurrency.

Plain continuous batching and fixed-block DSpark (the drafters bench's generic checkpoint, 4 drafts per
round) at c = 4 and 16 on held-out mixed-domain prompts, 64 tokens per request, three waves. With
``--against REV`` the same workload also runs on the engine of another git revision of this repository,
imported in the same process under another package name and interleaved with this one (order reversed
every other repetition), so an engine change is measured side by side: paired ratios new ÷ old, of the
whole run and of the time inside steps (prefills and departures left out).
"""

from __future__ import annotations

import importlib
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path

CONCURRENCY = (4, 16)
MODES = ("none", "fixed")


def _import_revision(rev: str, into: Path) -> str:
    """Extract ``dspark_core`` of git revision ``rev`` into ``into`` as its own package; returns its name."""
    repo = Path(__file__).resolve().parents[1]
    try:
        blob = subprocess.run(["git", "-C", str(repo), "archive", rev, "dspark_core"], check=True,
                              capture_output=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        raise ValueError(f"--against {rev!r}: cannot read that revision from the git checkout at {repo} "
                         f"({err.decode(errors='replace').strip() or exc})") from exc
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    name = "dspark_core_" + "".join(ch if ch.isalnum() else "_" for ch in rev)
    shutil.move(str(into / "dspark_core"), str(into / name))
    sys.path.insert(0, str(into))
    return name


@contextmanager
def package_revisions(against: str | None):
    """``{"this": get[, "against": get]}``, ``get(module_name)`` importing that module of this package or of
    git revision ``against`` (extracted under its own package name, removed on exit)."""
    tmp = Path(tempfile.mkdtemp(prefix="dspark-against-")) if against else None
    try:
        packages = {"this": __package__}
        if against:
            packages["against"] = _import_revision(against, tmp)
        yield {label: (lambda name, pkg=pkg: importlib.import_module(f"{pkg}.{name}")) for label, pkg in packages.items()}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def batch_suite(args, settings, log=print) -> dict:
    from dspark_core.bench.load import bench_checkpoint
    from dspark_core.data.bootstrap import heldout_records

    quick = bool(args.quick)
    home = settings.home
    ckpt = bench_checkpoint(args, home)
    reps = args.reps or (1 if quick else 4)
    max_new = args.max_new_tokens or (16 if quick else 64)
    conc = (4,) if quick else CONCURRENCY
    against = getattr(args, "against", None)
    with package_revisions(against) as revisions:
        engines = {}
        for label, mod in revisions.items():
            target = mod("cli").load_target_from_args(args, settings)
            prop = mod("proposers").build_proposer("dspark", target.runner, target.fingerprint, ckpt, block_size=4)
            engines[label] = (target, prop, mod("spec_batch"), mod("sampling"), mod("scheduler"))
        fingerprint = engines["this"][0].fingerprint
        recs = {d: heldout_records(home, d, fingerprint) for d in ("chat", "code", "math")}
        stream = [list(recs[d][i].prompt_ids) for i in range(64) for d in recs if i < len(recs[d])]
        if not stream:
            raise ValueError("no held-out traces: run dspark traces bootstrap first")
        runs: dict = {}
        for rep in range(reps):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            for label in order:
                target, prop, sb, sm, sch = engines[label]
                params = sm.SamplingParams(max_new_tokens=max_new, stop_token_ids=())
                for c in conc:
                    for mode in MODES:
                        reqs = [sb.SpecRequest(i, stream[i % len(stream)], params, prop if mode == "fixed" else None)
                                for i in range(3 * c)]
                        inside = [0, 0.0]

                        def on_step(rows, made, dt, inside=inside):
                            inside[0] += made
                            inside[1] += dt

                        t0 = time.perf_counter()
                        done = sb.run_requests(target.runner, reqs, sch.make_policy("fixed", k=4), max_batch=c,
                                               on_step=on_step)
                        wall = time.perf_counter() - t0
                        run = {"tok_s": sum(len(r.tokens) for r in done) / wall,
                               "step_tok_s": inside[0] / inside[1] if inside[1] else 0.0}
                        runs.setdefault(label, {}).setdefault(f"{mode}@{c}", []).append(run)
                        log(f"[batch] rep {rep + 1}/{reps} {label:7s} {mode:5s} c={c:2d}: {run['tok_s']:.1f} tok/s, "
                            f"{run['step_tok_s']:.1f} inside steps")
    med = {label: {k: {m: round(statistics.median(r[m] for r in v), 2) for m in ("tok_s", "step_tok_s")}
                   for k, v in by.items()} for label, by in runs.items()}
    result = {"suite": "batch", "quick": quick, "checkpoint": str(ckpt), "reps": reps, "max_new_tokens": max_new,
              "concurrency": list(conc), "requests_per_run": {str(c): 3 * c for c in conc}, "against": against,
              "tok_s": med, "runs": {label: {k: [{m: round(x, 2) for m, x in r.items()} for r in v]
                                             for k, v in by.items()} for label, by in runs.items()}}
    if against:
        result["ratio_vs_against_paired"] = {
            k: {m: round(statistics.median(a[m] / b[m] for a, b in zip(runs["this"][k], runs["against"][k])), 3)
                for m in ("tok_s", "step_tok_s")} for k in runs["this"]}
    return result


def render_markdown(result: dict) -> str:
    keys = list(result["tok_s"]["this"])
    against = result.get("against")
    head = "| run | this revision tok/s (inside steps) |" + (f" {against} tok/s (inside steps) | this ÷ {against}, "
                                                             "paired (inside steps) |" if against else "")
    lines = [head, "|---|---|" + ("---|---|" if against else "")]
    for k in keys:
        t = result["tok_s"]["this"][k]
        row = f"| {k} | {t['tok_s']:.1f} ({t['step_tok_s']:.1f}) |"
        if against:
            o, r = result["tok_s"]["against"][k], result["ratio_vs_against_paired"][k]
            row += f" {o['tok_s']:.1f} ({o['step_tok_s']:.1f}) | {r['tok_s']:.2f}x ({r['step_tok_s']:.2f}x) |"
        lines.append(row)
    return "\n".join(lines) + "\n"
