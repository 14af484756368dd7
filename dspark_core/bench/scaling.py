"""``dspark bench --suite scaling``: what holds held-out tau down, measured instead of guessed.

Two parts, on the traces the drafters bench bootstrapped (every domain's training and held-out split):

- **Scaling grid**: DSpark, DFlash and Eagle3-style drafters trained on nested subsets of the training
  sequences (``fractions``, 10x from the smallest to all of them) for the same number of steps (equal
  steps; each run's seconds are reported too, since an Eagle3-style step costs more), scored at
  ``milestones`` points along the run. Each score is teacher-forced
  (:func:`~dspark_core.training.train.teacher_forced_eval`): tau at T = 1 (``tau_expected``) and greedy
  (``tau_greedy``), per position, on every domain's held-out sequences and on as many training ones (the
  train / held-out gap). Blocks are drawn with one seed, so every drafter is scored on the same draws.
- **Ablations** of DSpark at the full data and the same steps, one change each against the baseline:
  the Markov head off and its rank, the confidence head off, draft layers, block size (gamma), anchors
  per sequence, the loss mix and position decay, the draft vocabulary, and greedy-only against
  sampled-only training data.

Each run is a job with a content key (its spec and the data); its folder under
``$DSPARK_HOME/bench/scaling/`` keeps the checkpoint (resumable) and ``scores.json`` (each milestone as it
is scored). A rerun skips finished jobs and resumes an interrupted one, and no job starts once
``budget_minutes`` have passed: the full suite runs in legs of a working session each, by rerunning the
same command, and the JSON says which jobs are still pending. ``only`` (``--jobs``) narrows a leg to the
named jobs, run in the order given, so the runs that answer the question at hand go first.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dspark_core.bench.inputs import Log
from dspark_core.data.bootstrap import heldout_records, training_records
from dspark_core.data.features import FeatureStore, training_taps
from dspark_core.drafters import build_drafter, drafter_config
from dspark_core.training.losses import LossConfig
from dspark_core.training.train import (Example, FeatureSource, TrainConfig, examples_from_records,
                                        teacher_forced_eval, top_token_vocab, train_drafter)

KINDS = ("dspark", "dflash", "eagle3")
DOMAINS = ("chat", "code", "math")


@dataclass(frozen=True)
class Job:
    """One training run: a drafter kind on a data subset, with overrides of the drafter, loss and training
    settings (an ablation), and which completions it trains on."""

    name: str
    kind: str
    fraction: float = 1.0
    drafter: tuple[tuple[str, object], ...] = ()       # DrafterConfig overrides
    loss: tuple[tuple[str, float], ...] = ()           # LossConfig overrides
    train: tuple[tuple[str, object], ...] = ()         # TrainConfig overrides (anchors_per_seq, ...)
    data: str = "all"                                  # all | greedy | sampled completions

    def spec(self) -> dict:
        d = asdict(self)
        d.pop("name")
        return d


ABLATIONS = (
    Job("markov-off", "dspark", drafter=(("markov_rank", 0),)),
    Job("markov-rank-16", "dspark", drafter=(("markov_rank", 16),)),
    Job("markov-rank-256", "dspark", drafter=(("markov_rank", 256),)),
    Job("confidence-off", "dspark", drafter=(("confidence_head", False),), loss=(("alpha_conf", 0.0),)),
    # the last context feature added to every slot's input, as the Eagle3-style drafter gets it straight
    # into its residual stream (the block drafters otherwise reach it only through attention)
    Job("context-input", "dspark", drafter=(("context_input", True),)),
    Job("layers-1", "dspark", drafter=(("num_layers", 1),)),
    Job("layers-3", "dspark", drafter=(("num_layers", 3),)),
    Job("layers-5", "dspark", drafter=(("num_layers", 5),)),
    Job("gamma-7", "dspark", drafter=(("block_size", 7),)),
    Job("anchors-16", "dspark", train=(("anchors_per_seq", 16),)),
    Job("anchors-64", "dspark", train=(("anchors_per_seq", 64),)),
    Job("loss-ce", "dspark", loss=(("alpha_ce", 1.0), ("alpha_tv", 0.0))),
    Job("loss-tv", "dspark", loss=(("alpha_ce", 0.0), ("alpha_tv", 1.0))),
    Job("decay-flat", "dspark", loss=(("decay", 1e6),)),
    Job("vocab-4096", "dspark", drafter=(("draft_vocab_size", 4096),)),
    Job("vocab-16384", "dspark", drafter=(("draft_vocab_size", 16384),)),
    Job("data-greedy", "dspark", data="greedy"),
    Job("data-sampled", "dspark", data="sampled"),
    # two changes at once, from the one-change runs: the paper's Markov rank lifts slots 2+ past the
    # Eagle3-style drafter's, which leads on slot 1 (the backbone's); hard CE, or the last context feature
    # in every slot's input as Eagle3 has it, may lift slot 1
    Job("rank-256-ce-0.5", "dspark", drafter=(("markov_rank", 256),), loss=(("alpha_ce", 0.5), ("alpha_tv", 0.5))),
    Job("rank-256-context", "dspark", drafter=(("markov_rank", 256), ("context_input", True))),
)


@dataclass(frozen=True)
class ScalingConfig:
    kinds: tuple[str, ...] = KINDS
    fractions: tuple[float, ...] = (0.1, 0.3, 1.0)
    steps: int = 600                 # every run, equal steps
    milestones: int = 4              # scored every steps / milestones steps
    batch_size: int = 4
    anchors: int = 32
    block_size: int = 5
    draft_vocab: int = 8192
    lr: float = 1e-3
    seed: int = 0
    eval_sequences: int = 48         # held-out sequences per domain (and as many training ones) scored
    eval_anchors: int = 32
    ablations: tuple[Job, ...] = ABLATIONS
    budget_minutes: float = 85.0     # no job starts after this; rerun the command to go on
    smoke: bool = False
    domains: tuple[str, ...] = DOMAINS
    only: tuple[str, ...] = ()       # run only these jobs this leg, in this order; the rest stay pending

    @classmethod
    def quick(cls) -> "ScalingConfig":
        return cls(fractions=(0.3, 1.0), steps=6, milestones=2, eval_sequences=3, eval_anchors=8,
                   ablations=ABLATIONS[:1] + ABLATIONS[3:4], budget_minutes=10.0, smoke=True)

    def grid(self) -> list[Job]:
        """Largest data first, every kind at each size before the next size: a leg that stops early still
        leaves a like-for-like comparison of the kinds."""
        return [Job(f"{k}-{f:g}", k, f) for f in sorted(self.fractions, reverse=True) for k in self.kinds]

    def jobs(self) -> list[Job]:
        return self.grid() + list(self.ablations)

    def milestone_steps(self) -> list[int]:
        return sorted({max(1, round(self.steps * (i + 1) / self.milestones)) for i in range(self.milestones)})


def _subset(examples: list[Example], fraction: float, seed: int) -> list[Example]:
    """A nested subset: the first ``fraction`` of one seeded order, so a smaller set is inside a larger."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n = max(1, round(fraction * len(examples)))
    return [examples[i] for i in sorted(order[:n])]


def _data(home: Path, fingerprint: str, domains: tuple[str, ...]) -> dict:
    """Training examples by completion kind (greedy / sampled) and the held-out examples per domain."""
    train = {"greedy": [], "sampled": []}
    for d in domains:
        for r in training_records(home, d, "train", fingerprint):
            kind = "greedy" if r.sampling.get("temperature") == 0 else "sampled"
            train[kind].extend(examples_from_records([r]))
    held = {d: examples_from_records(heldout_records(home, d, fingerprint)) for d in domains}
    return {"train": train, "heldout": held}


def _key(job: Job, cfg: ScalingConfig, data_key: str) -> str:
    spec = {"job": job.spec(), "steps": cfg.steps, "batch_size": cfg.batch_size, "anchors": cfg.anchors,
            "block_size": cfg.block_size, "draft_vocab": cfg.draft_vocab, "lr": cfg.lr, "seed": cfg.seed,
            "data": data_key, "eval": [cfg.eval_sequences, cfg.eval_anchors, cfg.milestones]}
    return hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _data_key(data: dict) -> str:
    h = hashlib.sha1()
    for kind in ("greedy", "sampled"):
        for e in data["train"][kind]:
            h.update(json.dumps([e.token_ids, e.response_start]).encode())
    for d, ex in sorted(data["heldout"].items()):
        h.update(d.encode())
        for e in ex:
            h.update(json.dumps([e.token_ids, e.response_start]).encode())
    return h.hexdigest()[:10]


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _score(target, model, data: dict, train_ex: list[Example], cfg: ScalingConfig, features) -> dict:
    """Teacher-forced scores on each domain's held-out sequences and on training ones (the gap)."""
    out = {}
    kw = dict(anchors_per_seq=cfg.eval_anchors, seed=cfg.seed + 17)
    for d, ex in data["heldout"].items():
        if ex:
            out[d] = teacher_forced_eval(target.runner, model, ex[:cfg.eval_sequences], features, **kw)
    sample = _subset(train_ex, min(1.0, cfg.eval_sequences * len(data["heldout"]) / max(1, len(train_ex))),
                     cfg.seed + 3)
    out["train"] = teacher_forced_eval(target.runner, model, sample, features, **kw)
    return {k: {m: (round(v, 4) if isinstance(v, float) else [round(x, 4) for x in v] if isinstance(v, list) else v)
                for m, v in s.items()} for k, s in out.items()}


def _run_job(target, job: Job, cfg: ScalingConfig, data: dict, folder: Path, features, log: Log) -> dict:
    """Train one job (resuming its folder) and score it at every milestone; returns its record."""
    scores_path = folder / "scores.json"
    record = json.loads(scores_path.read_text()) if scores_path.exists() else {}
    final = str(cfg.steps)
    if final in record.get("scores", {}):
        return record
    folder.mkdir(parents=True, exist_ok=True)
    pool = data["train"]["greedy"] + data["train"]["sampled"] if job.data == "all" else data["train"][job.data]
    train_ex = _subset(pool, job.fraction, cfg.seed)
    dover = {"block_size": cfg.block_size, "draft_vocab_size": cfg.draft_vocab, **dict(job.drafter)}
    dcfg = drafter_config(job.kind, target.runner.arch, **dover)
    model = build_drafter(dcfg, target.runner, seed=cfg.seed)
    if model.head.trimmed:
        model.head.set_vocab(top_token_vocab(train_ex, model.head.size, dcfg.vocab_size, target.stop_token_ids))
    loss = replace(LossConfig.preset(job.kind), **dict(job.loss))
    tcfg = replace(TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, anchors_per_seq=cfg.anchors, lr=cfg.lr,
                               seed=cfg.seed, checkpoint_every=max(1, cfg.steps // cfg.milestones), loss=loss),
                   **dict(job.train))
    record.update({"name": job.name, "kind": job.kind, "fraction": job.fraction, "spec": job.spec(),
                   "train_sequences": len(train_ex), "train_tokens": sum(len(e.token_ids) - e.response_start
                                                                         for e in train_ex)})
    record.setdefault("scores", {})
    record.setdefault("seconds", 0.0)
    marks = set(cfg.milestone_steps())
    clock = [time.perf_counter()]

    def on_step(step: int, metrics: dict) -> None:
        if step in marks and str(step) not in record["scores"]:
            now = time.perf_counter()            # training time since the last milestone (scoring excluded)
            record["seconds"] = round(record["seconds"] + now - clock[0], 1)
            record["scores"][str(step)] = {**_score(target, model, data, train_ex, cfg, features),
                                           "train_loss": round(metrics.get("loss", 0.0), 4)}
            clock[0] = time.perf_counter()
            _write_json(scores_path, record)
            held = [v["tau_greedy"] for d, v in record["scores"][str(step)].items() if d in cfg.domains]
            log(f"[scaling] {job.name} step {step}: held-out greedy tau (teacher-forced) "
                f"{sum(held) / max(1, len(held)):.3f}")

    train_drafter(target.runner, model, train_ex, tcfg, folder, target.fingerprint, on_step, progress=False,
                  features=features)
    if final not in record["scores"]:           # a run resumed past its last milestone: score it now
        on_step(cfg.steps, {})
    return record


def _mean_over_domains(score: dict, metric: str, domains: tuple[str, ...]) -> float | None:
    vals = [score[d][metric] for d in domains if d in score]
    return round(sum(vals) / len(vals), 4) if vals else None


def _mean_per_slot(score: dict, metric: str, domains: tuple[str, ...]) -> list[float]:
    """Per-slot ``metric`` (a list per domain) averaged over the domains that have it, slot by slot."""
    rows = [score[d][metric] for d in domains if d in score and isinstance(score[d].get(metric), list)]
    if not rows:
        return []
    return [round(sum(r[k] for r in rows if k < len(r)) / sum(k < len(r) for r in rows), 4)
            for k in range(max(len(r) for r in rows))]


def summarise(records: dict, cfg: ScalingConfig) -> dict:
    """Final-step held-out tau by kind and data fraction, DSpark's ratios to the baselines, the train /
    held-out gap, and each ablation's change against the DSpark baseline at the full data."""
    final = str(cfg.steps)
    done = {n: r for n, r in records.items() if final in r.get("scores", {})}
    table = {}
    for n, r in done.items():
        s = r["scores"][final]
        table[n] = {"tau_greedy": _mean_over_domains(s, "tau_greedy", cfg.domains),
                    "tau_expected": _mean_over_domains(s, "tau_expected", cfg.domains),
                    "train_tau_greedy": s["train"]["tau_greedy"],
                    "gap_greedy": round(s["train"]["tau_greedy"] - (_mean_over_domains(s, "tau_greedy", cfg.domains)
                                                                    or 0.0), 4),
                    "by_domain": {d: s[d]["tau_greedy"] for d in cfg.domains if d in s},
                    # P(slot k's draft is the target's greedy token), every slot scored teacher-forced
                    "greedy_per_slot": _mean_per_slot(s, "greedy_per_pos", cfg.domains),
                    "seconds": r.get("seconds")}
    ratios = {}
    for f in cfg.fractions:
        ds = table.get(f"dspark-{f:g}")
        for base in ("dflash", "eagle3"):
            b = table.get(f"{base}-{f:g}")
            if ds and b:
                ratios.setdefault(f"{f:g}", {})[f"dspark_vs_{base}"] = {
                    m: round(ds[m] / b[m], 3) for m in ("tau_greedy", "tau_expected") if b[m]}
    base = table.get(f"dspark-{max(cfg.fractions):g}")
    ablation = {}
    if base:
        for job in cfg.ablations:
            if job.name in table:
                ablation[job.name] = {m: round(table[job.name][m] - base[m], 4) for m in ("tau_greedy", "tau_expected")}
    return {"final": table, "ratios": ratios, "ablation_delta_vs_baseline": ablation}


def scaling_suite(target, cfg: ScalingConfig, home: Path, log: Log = print) -> dict:
    t_start = time.perf_counter()
    data = _data(home, target.fingerprint, cfg.domains)
    n_train = len(data["train"]["greedy"]) + len(data["train"]["sampled"])
    if not n_train or not any(data["heldout"].values()):
        raise ValueError("no training or held-out traces for this target; run: dspark bench --suite drafters "
                         "(or dspark traces bootstrap) first")
    dkey = _data_key(data)
    root = home / "bench" / "scaling"
    features = FeatureSource(target.runner, training_taps(target.runner.arch),
                             store=FeatureStore.for_target(home, target.fingerprint))
    records, pending = {}, []
    log(f"[scaling] {n_train} training sequences ({len(data['train']['greedy'])} greedy), held-out "
        f"{ {d: len(x) for d, x in data['heldout'].items()} }; {len(cfg.jobs())} jobs, budget "
        f"{cfg.budget_minutes:g} min")
    jobs = cfg.jobs()
    if cfg.only:                                  # the named jobs first, in the order given
        jobs.sort(key=lambda j: cfg.only.index(j.name) if j.name in cfg.only else len(cfg.only))
    for job in jobs:
        folder = root / f"{job.name}-{_key(job, cfg, dkey)}"
        scores = folder / "scores.json"
        finished = scores.exists() and str(cfg.steps) in json.loads(scores.read_text()).get("scores", {})
        if not finished and ((cfg.only and job.name not in cfg.only)
                             or (time.perf_counter() - t_start) / 60 > cfg.budget_minutes):
            pending.append(job.name)
            continue
        log(f"[scaling] {'cached' if finished else 'running'} {job.name} -> {folder}")
        records[job.name] = _run_job(target, job, cfg, data, folder, features, log)
    summary = summarise(records, cfg)
    plot = _plot(records, cfg, root / "scaling.png")
    return {"suite": "scaling", "quick": cfg.smoke,
            "config": {**{k: v for k, v in asdict(cfg).items() if k != "ablations"},
                       "ablations": [j.name for j in cfg.ablations], "milestone_steps": cfg.milestone_steps()},
            "data": {"train_sequences": n_train, "greedy": len(data["train"]["greedy"]),
                     "heldout": {d: len(x) for d, x in data["heldout"].items()}, "key": dkey},
            "jobs": records, "pending": pending, "complete": not pending, **summary,
            "plot": str(plot) if plot else None, "features": {"loaded": features.loaded, "computed": features.computed},
            "wall_seconds": round(time.perf_counter() - t_start, 1)}


def _plot(records: dict, cfg: ScalingConfig, path: Path) -> Path | None:
    if not records:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for kind in cfg.kinds:
        for f in cfg.fractions:
            r = records.get(f"{kind}-{f:g}")
            if not r:
                continue
            steps = sorted(int(s) for s in r["scores"])
            a.plot(steps, [_mean_over_domains(r["scores"][str(s)], "tau_greedy", cfg.domains) for s in steps],
                   marker="o", label=f"{kind} {f:g}")
        xs = [(r["train_tokens"], _mean_over_domains(r["scores"][str(cfg.steps)], "tau_greedy", cfg.domains))
              for f in cfg.fractions if (r := records.get(f"{kind}-{f:g}")) and str(cfg.steps) in r["scores"]]
        if xs:
            b.plot([x for x, _ in xs], [y for _, y in xs], marker="o", label=kind)
    a.set_xlabel("training steps")
    a.set_ylabel("held-out greedy tau (teacher-forced)")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    b.set_xscale("log")
    b.set_xlabel("training tokens")
    b.set_title(f"after {cfg.steps} steps")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_markdown(result: dict) -> str:
    fin = result.get("final", {})
    conf = result.get("config", {})
    doms = conf.get("domains") or DOMAINS
    lines = [f"Every run trains {conf.get('steps', '?')} steps on the {', '.join(doms)} traces and is scored on "
             f"{'its' if len(doms) == 1 else 'their'} held-out sequences.", "",
             "Held-out tau, teacher-forced, mean over domains, after the full run (greedy / T = 1); train - held-out "
             "gap (greedy):", "", "| run | training sequences | greedy tau | T = 1 tau | gap | seconds |",
             "|---|---|---|---|---|---|"]
    for name, t in fin.items():
        rec = result["jobs"][name]
        lines.append(f"| {name} | {rec['train_sequences']} | {t['tau_greedy']} | {t['tau_expected']} | "
                     f"{t['gap_greedy']} | {t['seconds']} |")
    for f, r in result.get("ratios", {}).items():
        lines.append("")
        lines.append(f"At data fraction {f}: " + "; ".join(
            f"{k} {v['tau_greedy']}x greedy, {v.get('tau_expected', '-')}x T = 1" for k, v in r.items()) + ".")
    slots = {n: t["greedy_per_slot"] for n, t in fin.items() if t.get("greedy_per_slot")}
    if slots:
        width = max(len(v) for v in slots.values())
        lines += ["", "Held-out greedy agreement per draft slot (how often slot k's draft is the target's greedy "
                  "token, every slot scored teacher-forced; mean over domains): slot 1 is the backbone's alone, "
                  "later slots also carry DSpark's Markov head or Eagle3's previous token:", "",
                  "| run | " + " | ".join(f"slot {k + 1}" for k in range(width)) + " |", "|---|" + "---|" * width]
        lines += [f"| {n} | " + " | ".join(f"{x:.3f}" for x in v) + " |" * (1 + width - len(v)) for n, v in slots.items()]
    if result.get("ablation_delta_vs_baseline"):
        lines += ["", "| ablation | Δ greedy tau | Δ T = 1 tau |", "|---|---|---|"]
        lines += [f"| {n} | {d['tau_greedy']:+.3f} | {d['tau_expected']:+.3f} |"
                  for n, d in result["ablation_delta_vs_baseline"].items()]
    if result.get("pending"):
        named = conf.get("only") or ()
        todo = [n for n in result["pending"] if not named or n in named]
        rest = [n for n in result["pending"] if n not in todo]
        if todo:
            lines += ["", f"Pending (rerun the command to go on): {', '.join(todo)}."]
        if rest:
            lines += ["", f"Not run by this command (name them with --jobs): {', '.join(rest)}."]
    return "\n".join(lines) + "\n"
