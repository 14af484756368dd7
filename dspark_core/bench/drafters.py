"""``dspark bench --suite drafters``: train DSpark, DFlash and Eagle3-style drafters with the same data and
compute budget, fine-tune DSpark per domain, then measure held-out tau and speedup side by side."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark_core.bench.inputs import Log
from dspark_core.calibration import Calibration, STSConfig, fit_sts
from dspark_core.data.bootstrap import BootstrapConfig, bootstrap_traces, heldout_records, training_records
from dspark_core.data.features import FeatureStore, training_taps
from dspark_core.data.prompts import load_prompts
from dspark_core.drafters import build_drafter, build_proposer, drafter_config, load_drafter
from dspark_core.drafters.modules import DrafterConfig
from dspark_core.engine.sampling import SamplingParams
from dspark_core.pipeline.evaluate import SideBySide, evaluate_side_by_side, paired_ratios, speedups
from dspark_core.pipeline.steps import collect_rounds
from dspark_core.scheduling.policy import ScheduledPolicy, SPSTable, StepCost
from dspark_core.scheduling.sps import profile_sps
from dspark_core.training.losses import LossConfig
from dspark_core.training.train import (FeatureSource, TrainConfig, examples_from_records, teacher_forced_eval,
                                        top_token_vocab, train_drafter)

DRAFTER_ORDER = ("dspark", "dspark-sched", "dspark-lookup", "dspark-reference-domain", "dspark-reference",
                 "dspark-generic", "dflash", "eagle3", "ngram")
# the trained checkpoints, scored teacher-forced on every held-out sequence (ngram and the policies that reuse
# a checkpoint are decoded only)
TRAINED = ("dspark", "dspark-reference-domain", "dspark-reference", "dspark-generic", "dflash", "eagle3")


@dataclass(frozen=True)
class DraftersBenchConfig:
    """The full run's budgets fit 60 minutes on a 2-core CPU from an empty ``DSPARK_HOME``."""

    domains: tuple[str, ...] = ("chat", "code", "math")
    per_domain: int = 432          # completions per domain (a source with fewer prompts samples its
                                   # training prompts several times: HumanEval has 164)
    heldout_fraction: float = 0.1
    greedy_train: bool = True      # plus one greedy completion of each training prompt (the evaluation
                                   # is greedy; serving-style samples alone rarely follow the greedy path)
    code_mined: int = 0            # `--code-mined N`: plus greedy completions of N docstring stubs mined from the
                                   # standard library (training only; `dspark traces bootstrap --code-from stdlib`);
                                   # off by default: they lengthen the bootstrap without raising held-out code tau
    bootstrap_max_new_tokens: int = 128  # as many tokens as the evaluation decodes
    bootstrap_batch: int = 32      # rows per batched generation step (`dspark bench --suite bootstrap` measures
                                   # 32 against 16)
    generic_steps: int = 700       # with the fine-tunes below, the step budget that fits the full run in 60 minutes
    domain_steps: int = 700        # per-domain fine-tune from the generic checkpoint ...
    domain_steps_by: tuple[tuple[str, int], ...] = (("code", 900), ("chat", 600), ("math", 500))
                                   # ... unless named here: code, the domain with a 1.3x speedup floor, gains most
                                   # per step, math is furthest above its floor; the three sum to 3 x 700
    batch_size: int = 4
    anchors: int = 32              # blocks sampled per sequence: the generic drafters (equal budget)
    domain_anchors: int = 64       # ... and the per-domain fine-tunes, which see one domain's fewer sequences
    block_size: int = 5            # γ, slots trained per block: every drafter verifies at most eval_block_size = 4
                                   # drafts here, and a drafter trained one slot past that reaches a higher tau than
                                   # one trained at 7 slots, in less training time
    draft_vocab: int = 8192
    lr: float = 1e-3
    eval_prompts: int = 8          # decoded held-out prompts per domain (`--prompts`): on 115 code prompts a tau
                                   # ratio between two drafters is known to about +-2.5 %, a speed ratio to +-5 %
    eval_max_new_tokens: int = 128
    eval_block_size: int = 4       # draft tokens verified per round, the same for every drafter
    calib_prompts: int = 16        # held-out prompts after the evaluated ones calibrate dspark-sched
    eval_reps: int = 2             # timed passes over the evaluation (rotated order, per-prompt medians)
    scheduled: bool = False        # also calibrate and evaluate `dspark-sched` (the scheduler at batch 1; the load
                                   # suite measures it where it matters, under concurrency): `--sched`
    seed: int = 0
    smoke: bool = False            # the smoke run's budgets (:meth:`quick`, `--quick`)
    reference: str | None = None   # a `dspark train --recipe` checkpoint (its `best` folder), evaluated beside the
                                   # equal-budget drafters as dspark-reference; `--reference DIR`
    reference_domain: tuple[tuple[str, str], ...] = ()   # (domain, checkpoint): that recipe fine-tuned on one
                                   # domain (`dspark train --recipe NAME --domain D --init .../best`), evaluated on
                                   # its domain as dspark-reference-domain; `--reference-domain D=DIR`
    tf_anchors: int = 32           # teacher-forced tau: blocks per held-out sequence

    @classmethod
    def quick(cls) -> "DraftersBenchConfig":
        return cls(per_domain=32, code_mined=8, heldout_fraction=0.2, bootstrap_max_new_tokens=96,
                   generic_steps=60, domain_steps=20, domain_steps_by=(), domain_anchors=32, eval_prompts=3,
                   eval_max_new_tokens=64, eval_reps=1, scheduled=True, smoke=True)

    def steps_for(self, domain: str) -> int:
        """Fine-tune steps of one domain's drafter."""
        return dict(self.domain_steps_by).get(domain, self.domain_steps)

    def drafters(self) -> tuple[str, ...]:
        """The evaluated drafters, in table order."""
        return tuple(k for k in DRAFTER_ORDER if (self.scheduled or k != "dspark-sched")
                     and (self.reference or k != "dspark-reference")
                     and (self.reference_domain or k != "dspark-reference-domain"))

    def reference_for(self, domain: str) -> Path | None:
        """The per-domain recipe fine-tune evaluated on ``domain`` (``--reference-domain``), if any."""
        ckpt = dict(self.reference_domain).get(domain)
        return Path(ckpt) if ckpt else None

    def drafters_for(self, domain: str) -> tuple[str, ...]:
        """The drafters evaluated on one domain: a per-domain reference only where one is given."""
        return tuple(k for k in self.drafters()
                     if k != "dspark-reference-domain" or self.reference_for(domain) is not None)

    def train_key(self) -> str:
        keys = ("per_domain", "heldout_fraction", "greedy_train", "bootstrap_max_new_tokens", "batch_size",
                "anchors", "block_size", "draft_vocab", "lr", "seed")
        key = {k: asdict(self)[k] for k in keys}
        if self.code_mined and "code" in self.domains:   # only when used: other runs keep their key
            key["code_mined"] = self.code_mined
        return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]


def _cached_meta(folder: Path) -> dict:
    """A cached checkpoint folder's metadata ({} when there is none)."""
    meta = folder / "config.json"
    return json.loads(meta.read_text()) if meta.exists() else {}


@dataclass(frozen=True)
class TrainJob:
    """One drafter to train: its kind, step budget and folder; a fine-tune starts from ``init``."""

    kind: str
    steps: int
    out: Path
    init: Path | None = None
    anchors: int | None = None      # blocks per sequence (default: the config's ``anchors``)


def _train(target, job: TrainJob, examples, cfg: DraftersBenchConfig, log: Log, features=None) -> dict:
    """Train ``job`` (or reuse its folder when it holds that budget, finished); returns its training info."""
    kind, steps, out, init = job.kind, job.steps, job.out, job.init
    anchors = job.anchors or cfg.anchors
    meta = _cached_meta(out)
    # the architecture this code builds (a fine-tune keeps its generic drafter's, built the same way)
    dcfg = drafter_config(kind, target.runner.arch, block_size=cfg.block_size, draft_vocab_size=cfg.draft_vocab)
    cached = DrafterConfig.from_dict(meta["config"]) if meta.get("config") is not None else None
    if cached is not None and cached != dcfg:
        differ = sorted(k for k, v in dcfg.to_dict().items() if cached.to_dict()[k] != v)
        log(f"[drafters] {out} holds another architecture ({', '.join(differ)}): training it again")
        shutil.rmtree(out)
        meta = {}
    # the budget it was (or is being) trained for; a folder that does not record its anchors used 32
    budget = meta.get("train", {})
    budget = (budget["steps"], budget.get("anchors_per_seq", 32)) if "steps" in budget else None
    if budget == (steps, anchors) and meta.get("step") == steps:
        log(f"[drafters] reusing {out}")
        return meta.get("bench_train", {})
    if budget is not None and budget != (steps, anchors):   # another budget: resuming it would mix schedules
        log(f"[drafters] {out} was trained for {budget[0]} steps x {budget[1]} anchors, not {steps} x {anchors}: "
            "training it again")
        shutil.rmtree(out)
    if init is not None:
        model = load_drafter(init, target.runner, target.fingerprint)
    else:
        model = build_drafter(dcfg, target.runner, seed=cfg.seed)
        model.head.set_vocab(top_token_vocab(examples, cfg.draft_vocab, dcfg.vocab_size, target.stop_token_ids))
    tcfg = TrainConfig(steps=steps, batch_size=cfg.batch_size, anchors_per_seq=anchors, lr=cfg.lr,
                       seed=cfg.seed, checkpoint_every=max(50, steps // 4), loss=LossConfig.preset(kind))
    t0 = time.perf_counter()
    res = train_drafter(target.runner, model, examples, tcfg, out, target.fingerprint,
                        extra_meta={"examples": len(examples), "init": str(init) if init else None},
                        features=features)
    info = {"seconds": round(time.perf_counter() - t0, 1), "steps": steps, "anchors": anchors,
            "examples": len(examples),
            "final_loss": round(res.final_metrics.get("loss", 0.0), 4),
            "teacher_forced_tau": round(res.final_metrics.get("tau_expected", 0.0), 4)}
    meta = json.loads((out / "config.json").read_text())
    meta["bench_train"] = info
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    return info


def _bootstrap(target, cfg: DraftersBenchConfig, home: Path, taps, log: Log) -> dict:
    """Step 1: traces of every domain (sampled at the serving default, plus greedy and mined code when
    configured), storing the training sequences' target features as they are generated."""
    boot = {}
    for d in cfg.domains:
        n_src = len(load_prompts(d, cfg.per_domain, cfg.seed))
        runs = {"sampled": {"samples_per_prompt": -(-cfg.per_domain // n_src)}}   # serving default
        if cfg.greedy_train:
            runs["greedy"] = {"sampling": {"temperature": 0.0}, "train_only": True}
        if d == "code" and cfg.code_mined:
            runs["stdlib"] = {"sampling": {"temperature": 0.0}, "code_from": "stdlib", "per_domain": cfg.code_mined}
        for name, extra in runs.items():
            extra = dict(extra)
            n = extra.pop("per_domain", cfg.per_domain)
            run = BootstrapConfig((d,), n, cfg.seed, batch_size=cfg.bootstrap_batch,
                                  max_new_tokens=cfg.bootstrap_max_new_tokens,
                                  heldout_fraction=cfg.heldout_fraction, feature_taps=taps, **extra)
            got = bootstrap_traces(target, home, run, log=log)[d]
            boot.setdefault(d, {})[name] = {k: got[k] for k in ("new", "skipped", "tokens", "seconds", "tokens_per_s",
                                                                "features_stored")}
    return boot


def _train_all(target, cfg: DraftersBenchConfig, home: Path, root: Path, features, log: Log) -> dict:
    """Step 2: the generic DSpark, DFlash and Eagle3-style drafters on every domain's training traces (same
    data, same steps), then one DSpark fine-tune per domain from the generic one."""
    train_ex = {d: examples_from_records(training_records(home, d, "train", target.fingerprint)) for d in cfg.domains}
    all_train = [e for d in cfg.domains for e in train_ex[d]]
    training = {}
    for kind in ("dspark", "dflash", "eagle3"):
        training[f"{kind}-generic"] = _train(target, TrainJob(kind, cfg.generic_steps, root / f"{kind}-generic"),
                                             all_train, cfg, log, features)
    for d in cfg.domains:
        job = TrainJob("dspark", cfg.steps_for(d), root / f"dspark-{d}", init=root / "dspark-generic",
                       anchors=cfg.domain_anchors)
        training[f"dspark-{d}"] = _train(target, job, train_ex[d], cfg, log, features)
    return training


def _checkpoints(root: Path, domain: str, cfg: DraftersBenchConfig) -> dict[str, Path]:
    """The trained drafters' checkpoints for one domain, by table name."""
    out = {"dspark": root / f"dspark-{domain}", "dspark-generic": root / "dspark-generic",
           "dflash": root / "dflash-generic", "eagle3": root / "eagle3-generic"}
    if cfg.reference_for(domain) is not None:
        out["dspark-reference-domain"] = cfg.reference_for(domain)
    if cfg.reference:
        out["dspark-reference"] = Path(cfg.reference)
    return out


def _proposers(target, root: Path, domain: str, cfg: DraftersBenchConfig) -> dict:
    """Every evaluated drafter of one domain, plain decoding ("none") first."""
    domain_ckpt = root / f"dspark-{domain}"
    ref = ({"dspark-reference": build_proposer("dspark", target.runner, target.fingerprint, Path(cfg.reference))}
           if cfg.reference else {})
    if cfg.reference_for(domain) is not None:
        ref = {"dspark-reference-domain": build_proposer("dspark", target.runner, target.fingerprint,
                                                         cfg.reference_for(domain)), **ref}
    return {"none": None,
            "dspark": build_proposer("dspark", target.runner, target.fingerprint, domain_ckpt),
            # the same domain drafter behind prompt lookup (a copy where the text repeats itself)
            "dspark-lookup": build_proposer("dspark-lookup", target.runner, target.fingerprint, domain_ckpt),
            **ref,
            "dspark-generic": build_proposer("dspark", target.runner, target.fingerprint, root / "dspark-generic"),
            "dflash": build_proposer("dflash", target.runner, target.fingerprint, root / "dflash-generic"),
            "eagle3": build_proposer("eagle3", target.runner, target.fingerprint, root / "eagle3-generic"),
            "ngram": build_proposer("ngram", target.runner, target.fingerprint)}


def _teacher_forced(target, cfg: DraftersBenchConfig, home: Path, root: Path, features, log: Log) -> dict:
    """Every trained drafter scored teacher-forced on *every* held-out sequence of each domain (the decoded
    evaluation covers the first ``eval_prompts``): tau greedy and at T = 1 (what speculative sampling accepts),
    with the blocks and tokens scored. No decoding: the target's features at fixed-seed anchors."""
    out = {}
    for d in cfg.domains:
        ex = examples_from_records(heldout_records(home, d, target.fingerprint))
        per = {}
        for name, ckpt in _checkpoints(root, d, cfg).items():
            model = load_drafter(ckpt, target.runner, target.fingerprint)
            r = teacher_forced_eval(target.runner, model, ex, features, anchors_per_seq=cfg.tf_anchors, seed=cfg.seed)
            per[name] = {"greedy": round(r["tau_greedy"], 3), "t1": round(r["tau_expected"], 3),
                         "blocks": r["blocks"]}
        out[d] = {"sequences": len(ex), "tokens": sum(len(e.token_ids) - e.response_start for e in ex), **per}
        log(f"[drafters] teacher-forced tau on {len(ex)} held-out {d} sequences: "
            + ", ".join(f"{k} {v['greedy']:.2f} / {v['t1']:.2f}" for k, v in per.items()) + " (greedy / T = 1)")
    return out


def _reference_info(ckpt: Path) -> dict:
    """What the recipe run behind a reference checkpoint recorded (``recipe.json`` beside its ``best/``): the
    recipe, its status, the best step and the held-out scores along the run; {} for another checkpoint."""
    state = Path(ckpt).parent / "recipe.json"
    meta = _cached_meta(Path(ckpt))
    if not state.exists():
        return {"checkpoint": str(ckpt), "step": meta.get("step")}
    st = json.loads(state.read_text())
    return {"checkpoint": str(ckpt), "recipe": st["recipe"].get("name"), "status": st.get("status"),
            "legs": st.get("legs"), "train_seconds": st.get("train_seconds"), "step": meta.get("step"),
            "scores": [{k: x[k] for k in ("step", "tau_greedy", "tau_expected")} for x in st.get("scores", [])]}


# the pairs reported with ranges (``versus``): the equal-budget ordering, and each DSpark drafter against lookup
_VERSUS = (("dspark-generic", "dflash"), ("dspark-generic", "eagle3"), ("dspark", "dspark-generic"),
           ("dspark", "ngram"), ("dspark-reference", "ngram"), ("dspark-reference-domain", "ngram"),
           ("dspark-reference-domain", "dspark-reference"))


def _evaluate(target, cfg: DraftersBenchConfig, home: Path, root: Path, log: Log) -> dict:
    """Step 3: every drafter side by side on each domain's held-out prompts: tau, speedup over plain
    decoding, acceptance per draft position, tok/s and where a round's time goes."""
    out = {k: {} for k in ("tau", "speedup", "speedup_range", "versus", "acceptance_per_position", "tok_s",
                           "round_ms")}
    params = SamplingParams(max_new_tokens=cfg.eval_max_new_tokens, stop_token_ids=target.stop_token_ids)
    for d in cfg.domains:
        held = heldout_records(home, d, target.fingerprint)
        heldout, calib = held[:cfg.eval_prompts], held[cfg.eval_prompts:cfg.eval_prompts + cfg.calib_prompts]
        sched = ({"dspark-sched": _scheduled(target, root / f"dspark-{d}", calib, cfg, log)} if cfg.scheduled
                 else {})
        log(f"[drafters] evaluating {d} on {len(heldout)} held-out prompts")
        how = SideBySide(params, cfg.seed, block_size=cfg.eval_block_size, reps=cfg.eval_reps)
        res = evaluate_side_by_side(target.runner, _proposers(target, root, d, cfg), [list(r.prompt_ids) for r in heldout],
                                    how, scheduled=sched, log=log)
        sp = speedups(res)
        out["tau"][d] = {k: round(res[k].tau, 3) for k in cfg.drafters_for(d)}
        out["speedup"][d] = {k: round(sp[k], 3) for k in cfg.drafters_for(d)}
        # 5-95 % over paired resamples of the prompts: each speedup, and the comparisons the goals name
        vs_plain = {k: paired_ratios(res, k, "none", seed=cfg.seed)["speed_ratio"] for k in cfg.drafters_for(d)}
        out["speedup_range"][d] = {k: [r["low"], r["high"]] for k, r in vs_plain.items()}
        out["versus"][d] = {f"{a} / {b}": paired_ratios(res, a, b, seed=cfg.seed) for a, b in _VERSUS
                            if a in res and b in res}
        out["acceptance_per_position"][d] = {k: [round(x, 3) for x in res[k].acceptance_per_position()]
                                             for k in cfg.drafters_for(d)}
        out["tok_s"][d] = {k: round(r.tok_s, 2) for k, r in res.items()}
        # where a round goes: drafting and the verify forward, ms per round over every timed pass ("none":
        # a plain step's forward); what is left of a round (acceptance, commit) is its wall time minus both
        out["round_ms"][d] = {k: r.round_ms() for k, r in res.items() if r.round_ms() is not None}
    return out


def drafters_suite(target, cfg: DraftersBenchConfig, home: Path, log: Log = print) -> dict:
    """Bootstrap, train and evaluate (:func:`_bootstrap`, :func:`_train_all`, :func:`_evaluate`). Every
    phase is cached under ``home``: traces and target features by target, checkpoints by
    :meth:`DraftersBenchConfig.train_key`, so a second run only evaluates."""
    t_start = time.perf_counter()
    log(f"[drafters] {'quick' if cfg.smoke else 'full'} run, target {target.name} in {target.runner.dtype}")
    # one feature source for every training: bootstrap stores the training sequences' target features
    # (the union of the drafters' tap layers) as it generates them; the rest run through the target once
    taps = training_taps(target.runner.arch)
    boot = _bootstrap(target, cfg, home, taps, log)
    t_boot = time.perf_counter()
    root = home / "bench" / f"drafters-{cfg.train_key()}"
    features = FeatureSource(target.runner, taps, store=FeatureStore.for_target(home, target.fingerprint))
    training = _train_all(target, cfg, home, root, features, log)
    t_train = time.perf_counter()
    log(f"[drafters] target features: {features.loaded} training sequences read from the store, "
        f"{features.computed} computed")
    if cfg.reference:
        load_drafter(Path(cfg.reference), target.runner, target.fingerprint)     # a clear error before the long part
        log(f"[drafters] evaluating the recipe checkpoint {cfg.reference} as dspark-reference")
    for d, ckpt in cfg.reference_domain:
        load_drafter(Path(ckpt), target.runner, target.fingerprint)
        log(f"[drafters] evaluating the recipe checkpoint {ckpt} on {d} as dspark-reference-domain")
    ev = _evaluate(target, cfg, home, root, log)
    ev["tau_teacher_forced"] = _teacher_forced(target, cfg, home, root, features, log)
    if cfg.reference:
        ev["reference"] = _reference_info(Path(cfg.reference))
    if cfg.reference_domain:
        ev["reference_domain"] = {d: _reference_info(Path(ckpt)) for d, ckpt in cfg.reference_domain}
    _plot(ev["acceptance_per_position"], root / "acceptance.png")
    log(f"[drafters] wrote {root / 'acceptance.png'}")
    return {"suite": "drafters", "quick": cfg.smoke, "config": asdict(cfg),
            "target": {"name": target.name, "fingerprint": target.fingerprint, "dtype": str(target.runner.dtype)},
            **ev, "bootstrap": boot, "training": training, "checkpoints": str(root),
            "features": {"loaded": features.loaded, "computed": features.computed},
            "checks": _checks(ev["tau"], ev["speedup"], ev["tau_teacher_forced"]),
            "wall_seconds": round(time.perf_counter() - t_start, 1),
            # training includes reading the traces; a phase served from the caches takes seconds
            "phase_seconds": {"bootstrap": round(t_boot - t_start, 1), "training": round(t_train - t_boot, 1),
                              "evaluation": round(time.perf_counter() - t_train, 1)}}


def _scheduled(target, ckpt: Path, calib_records, cfg: DraftersBenchConfig, log: Log):
    """The domain's DSpark drafter with its scheduler, as served at batch 1: STS (+ shift) calibration
    fitted on greedy rounds of held-out prompts that are not evaluated, SPS(B) profiled here at one row,
    verify length (and whether to draft at all) chosen per round by the scheduled policy, at most
    ``eval_block_size`` drafts like every other drafter."""
    k = cfg.eval_block_size
    prop = build_proposer("dspark", target.runner, target.fingerprint, ckpt, block_size=k)
    cal = Calibration.identity(k)
    if calib_records:
        conf, acc = collect_rounds(target.runner, prop, [list(r.prompt_ids) for r in calib_records],
                                   cfg.eval_max_new_tokens, 0.0, target.stop_token_ids, cfg.seed)
        cal = fit_sts(conf, acc, STSConfig(min_rounds=50, shift=True))
        log(f"[drafters] {ckpt.name}: STS on {cal.rounds} greedy rounds of {len(calib_records)} other held-out "
            f"prompts, ECE {[round(m['ece'], 3) for m in cal.raw]} -> {[round(m['ece'], 3) for m in cal.calibrated]}")
    prof = profile_sps(target.runner, prop, k + 1, reps=5, context=192, block=k, rows=1)
    cost = StepCost.from_profile(prof)
    return (prop, ScheduledPolicy({1: SPSTable(tuple(prof["sps"]))}, k=k, costs={1: cost} if cost else None),
            cal.apply)


# speedup goals of the recipe-trained drafter alone, per domain (beyond: code 2.5, chat 1.6, math 3.0)
REFERENCE_SPEEDUP_GOAL = {"code": 2.0, "chat": 1.5, "math": 2.5}


def _checks(tau: dict, speed: dict, tf: dict | None = None) -> dict:
    """The issue's floors and targets, evaluated on this run's numbers (reported, not asserted)."""
    out = {}
    for d in tau:
        t = tau[d]
        ratios = {}
        for name, key in (("dspark-reference", "reference"), ("dspark-reference-domain", "reference_domain")):
            if name not in speed[d]:
                continue
            ref = speed[d][name]
            ratios[f"{key}_vs_ngram_speedup"] = round(ref / speed[d]["ngram"], 3) if speed[d].get("ngram") else None
            if d in REFERENCE_SPEEDUP_GOAL:
                ratios[f"{key}_speedup_goal"] = REFERENCE_SPEEDUP_GOAL[d]
                ratios[f"{key}_meets_speedup_goal"] = ref >= REFERENCE_SPEEDUP_GOAL[d]
        if "dspark-reference-domain" in t and t.get("dspark-reference"):
            # per-domain fine-tune over the generic recipe drafter it started from (goal 1.15)
            ratios["tau_ratio_reference_domain_vs_reference"] = round(t["dspark-reference-domain"]
                                                                      / t["dspark-reference"], 3)
        for mode in ("greedy", "t1"):        # teacher-forced, every held-out sequence
            f = (tf or {}).get(d, {})
            for base in ("dflash", "eagle3"):
                if "dspark-generic" in f and f.get(base, {}).get(mode):
                    ratios[f"tf_{mode}_ratio_vs_{base}"] = round(f["dspark-generic"][mode] / f[base][mode], 3)
        out[d] = {"dspark_faster_than_plain": speed[d]["dspark"] > 1.0,
                  **({"dspark_sched_faster_than_plain": speed[d]["dspark-sched"] > 1.0}
                     if "dspark-sched" in speed[d] else {}),
                  "dspark_lookup_faster_than_plain": speed[d]["dspark-lookup"] > 1.0,
                  "tau_dspark_gt_dflash": t["dspark-generic"] > t["dflash"],
                  "domain_beats_generic": t["dspark"] > t["dspark-generic"],
                  "tau_ratio_vs_dflash": round(t["dspark-generic"] / t["dflash"], 3) if t["dflash"] else None,
                  "tau_ratio_vs_eagle3": round(t["dspark-generic"] / t["eagle3"], 3) if t["eagle3"] else None,
                  "tau_ratio_domain_vs_generic": round(t["dspark"] / t["dspark-generic"], 3)
                  if t["dspark-generic"] else None, **ratios}
    return out


def render_markdown(result: dict) -> str:
    names = [k for k in DRAFTER_ORDER if any(k in per for per in result["tau"].values())]

    def cell(per: dict, k: str, fmt: str) -> str:
        return format(per[k], fmt) if k in per else "–"

    ref = result.get("reference")
    head = []
    if ref and ref.get("scores"):
        curve = ", ".join(f"{x['step']}: {x['tau_greedy']:.3f} / {x['tau_expected']:.3f}" for x in ref["scores"])
        head = [f"`dspark-reference`: the `{ref['recipe']}` recipe's best checkpoint (step {ref['step']}; the run "
                f"is {ref['status']} after {ref['legs']} leg(s), {ref['train_seconds'] / 60:.0f} min of training). "
                f"Its held-out teacher-forced tau, mean over domains, greedy / T = 1, by step: {curve}.", ""]
    tuned = result.get("reference_domain") or {}
    if tuned:
        parts = []
        for d, info in tuned.items():
            sc = info.get("scores") or []
            start = next((x for x in sc if x["step"] == 0), None)
            parts.append(f"{d}: step {info.get('step')}" + (f" of {sc[-1]['step']} ({info.get('status')}), held-out "
                         f"teacher-forced tau greedy {start['tau_greedy']:.3f} at the start, "
                         f"{max(x['tau_greedy'] for x in sc):.3f} at best" if start else ""))
        head += ["`dspark-reference-domain`: the recipe drafter fine-tuned on each domain from `dspark-reference` "
                 "(`dspark train --recipe NAME --domain D --init .../best`), best checkpoint: " + "; ".join(parts)
                 + ".", ""]
    lines = head + ["| domain | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for d in result["tau"]:
        lines.append(f"| {d} | tau | " + " | ".join(cell(result["tau"][d], k, ".2f") for k in names) + " |")
        tf = result.get("tau_teacher_forced", {}).get(d)
        if tf:
            lines.append(f"| {d} | tau teacher-forced, {tf['sequences']} held-out sequences: greedy / T = 1 | "
                         + " | ".join(f"{tf[k]['greedy']:.2f} / {tf[k]['t1']:.2f}" if k in tf else "–" for k in names)
                         + " |")
        rng = result.get("speedup_range", {}).get(d, {})
        lines.append(f"| {d} | speedup{' (5-95 %)' if rng else ''} | " + " | ".join(
            cell(result["speedup"][d], k, ".2f") + "x" * (k in result["speedup"][d])
            + (f" ({rng[k][0]:.2f}-{rng[k][1]:.2f})" if k in rng else "") for k in names) + " |")
        ms = result.get("round_ms", {}).get(d, {})
        if "none" in ms and all(k in ms for k in names if k in result["tau"][d]):
            lines.append(f"| {d} | ms per round: draft + verify (plain step {ms['none']['verify']:.1f}) | "
                         + " | ".join(f"{ms[k]['draft']:.1f} + {ms[k]['verify']:.1f}" if k in ms else "–"
                                      for k in names) + " |")
    versus = [(d, k, v) for d, per in result.get("versus", {}).items() for k, v in per.items()]
    if versus:
        lines += ["", "| domain | ratio | tau | speed | prompts |", "|---|---|---|---|---|"]
        lines += [f"| {d} | {k} | {v['tau_ratio']['value']:.3f} ({v['tau_ratio']['low']:.3f}-"
                  f"{v['tau_ratio']['high']:.3f}) | {v['speed_ratio']['value']:.3f} ({v['speed_ratio']['low']:.3f}-"
                  f"{v['speed_ratio']['high']:.3f}) | {v['prompts']} |" for d, k, v in versus]
        lines += ["", "Ranges: 5-95 % over paired resamples of the decoded prompts."]
    return "\n".join(lines) + "\n"


def _plot(accept: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(accept), figsize=(5 * len(accept), 3.6), squeeze=False)
    for ax, (d, per) in zip(axes[0], accept.items()):
        for name in DRAFTER_ORDER:
            ys = per.get(name)
            if ys:
                ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
        ax.set_title(f"{d}: acceptance per draft position")
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(accepted | verified)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
