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
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from types import ModuleType

from dspark_core.bench.inputs import Log
from dspark_core.bench.record import repo_root
from dspark_core.data.bootstrap import heldout_records

CONCURRENCY = (4, 16)
MODES = ("none", "fixed")

# Where each part of the engine lives in a revision, the package layout first, then the flat module
# names of revisions from before it (``dspark_core.runner``, ``dspark_core.batch``, ``dspark_core.proposers``).
REVISION_MODULES = {
    "target": ("model.target", "target"),                 # load_target
    "runner": ("model.runner", "runner"),                 # TargetRunner
    "drafters": ("drafters", "proposers"),                # build_proposer
    "sampling": ("engine.sampling", "sampling"),          # SamplingParams
    "spec_batch": ("engine.spec_batch", "spec_batch"),    # SpecRequest, run_requests
    "plain_batch": ("engine.plain_batch", "batch"),       # BatchRequest, generate_batch
    "inputs": ("engine.inputs", "engine"),                # make_generator
    "policy": ("scheduling", "scheduler"),                # make_policy
}


def _import_revision(rev: str, into: Path) -> str:
    """Extract ``dspark_core`` of git revision ``rev`` into ``into`` as its own package; returns its name.
    Its absolute imports of ``dspark_core`` are renamed to that package, so none of its modules reaches
    into this revision's."""
    repo = repo_root() or Path(__file__).resolve().parents[2]
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
    for src in (into / name).rglob("*.py"):
        src.write_text(re.sub(r"\bdspark_core\b", name, src.read_text()))
    sys.path.insert(0, str(into))
    return name


def revision_module(package: str, role: str) -> ModuleType:
    """The module of ``package`` (this one or an imported revision) that plays ``role`` in
    :data:`REVISION_MODULES`, under whichever layout that revision has."""
    for name in REVISION_MODULES[role]:
        full = f"{package}.{name}"
        try:
            return importlib.import_module(full)
        except ModuleNotFoundError as exc:            # this layout lacks it; an error inside the module is raised
            if not (exc.name == full or full.startswith(f"{exc.name}.")):
                raise
    raise ModuleNotFoundError(f"{package} has none of {', '.join(REVISION_MODULES[role])} ({role})")


@contextmanager
def package_revisions(against: str | None):
    """``{"this": get[, "against": get]}``, ``get(role)`` importing the module that plays that role
    (:data:`REVISION_MODULES`) in this package or in git revision ``against`` (extracted under its own
    package name, removed on exit)."""
    tmp = Path(tempfile.mkdtemp(prefix="dspark-against-")) if against else None
    try:
        packages = {"this": __package__.split(".")[0]}
        if against:
            packages["against"] = _import_revision(against, tmp)
        yield {label: (lambda role, pkg=pkg: revision_module(pkg, role)) for label, pkg in packages.items()}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def revision_target(mod, target):
    """``target`` loaded again by a revision's own code (same folder, dtype and device)."""
    return mod("target").load_target(target.path, dtype=target.runner.dtype, device=str(target.runner.device))


@dataclass(frozen=True)
class BatchBenchConfig:
    checkpoint: Path                # the DSpark drafter (default: the drafters bench's generic one)
    reps: int = 4                   # interleaved repetitions (order reversed every other one)
    max_new_tokens: int = 64
    concurrency: tuple[int, ...] = CONCURRENCY
    against: str | None = None      # a git revision to run beside this one
    smoke: bool = False             # `--quick`: the preset :meth:`quick`

    @classmethod
    def quick(cls, checkpoint: Path, against: str | None = None) -> "BatchBenchConfig":
        return cls(checkpoint=checkpoint, reps=1, max_new_tokens=16, concurrency=(4,), against=against, smoke=True)


def _engines(revisions, target, ckpt: Path) -> dict:
    """Per revision label: its target, its DSpark proposer and the modules the run calls."""
    engines = {}
    for label, mod in revisions.items():
        rev_target = target if label == "this" else revision_target(mod, target)
        prop = mod("drafters").build_proposer("dspark", rev_target.runner, rev_target.fingerprint, ckpt, block_size=4)
        engines[label] = (rev_target, prop, mod("spec_batch"), mod("sampling"), mod("policy"))
    return engines


def _one_run(engine, stream, mode: str, c: int, max_new: int) -> dict:
    target, prop, sb, sm, sch = engine
    params = sm.SamplingParams(max_new_tokens=max_new, stop_token_ids=())
    reqs = [sb.SpecRequest(i, stream[i % len(stream)], params, prop if mode == "fixed" else None)
            for i in range(3 * c)]
    inside = [0, 0.0]                                   # tokens made inside steps, seconds inside steps

    def on_step(rows, made, dt):
        inside[0] += made
        inside[1] += dt

    t0 = time.perf_counter()
    done = sb.run_requests(target.runner, reqs, sch.make_policy("fixed", k=4), max_batch=c, on_step=on_step)
    wall = time.perf_counter() - t0
    return {"tok_s": sum(len(r.tokens) for r in done) / wall,
            "step_tok_s": inside[0] / inside[1] if inside[1] else 0.0}


def batch_suite(target, cfg: BatchBenchConfig, home: Path, log: Log = print) -> dict:
    with package_revisions(cfg.against) as revisions:
        engines = _engines(revisions, target, cfg.checkpoint)
        recs = {d: heldout_records(home, d, target.fingerprint) for d in ("chat", "code", "math")}
        stream = [list(recs[d][i].prompt_ids) for i in range(64) for d in recs if i < len(recs[d])]
        if not stream:
            raise ValueError("no held-out traces: run dspark traces bootstrap first")
        runs: dict = {}
        for rep in range(cfg.reps):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            for label in order:
                for c in cfg.concurrency:
                    for mode in MODES:
                        run = _one_run(engines[label], stream, mode, c, cfg.max_new_tokens)
                        runs.setdefault(label, {}).setdefault(f"{mode}@{c}", []).append(run)
                        log(f"[batch] rep {rep + 1}/{cfg.reps} {label:7s} {mode:5s} c={c:2d}: {run['tok_s']:.1f} "
                            f"tok/s, {run['step_tok_s']:.1f} inside steps")
    med = {label: {k: {m: round(statistics.median(r[m] for r in v), 2) for m in ("tok_s", "step_tok_s")}
                   for k, v in by.items()} for label, by in runs.items()}
    result = {"suite": "batch", "quick": cfg.smoke, "checkpoint": str(cfg.checkpoint), "reps": cfg.reps,
              "max_new_tokens": cfg.max_new_tokens, "concurrency": list(cfg.concurrency),
              "requests_per_run": {str(c): 3 * c for c in cfg.concurrency}, "against": cfg.against,
              "tok_s": med, "runs": {label: {k: [{m: round(x, 2) for m, x in r.items()} for r in v]
                                             for k, v in by.items()} for label, by in runs.items()}}
    if cfg.against:
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
