"""Pipeline steps as plain functions: train, calibrate, evaluate (with a lossless check), profile SPS.

Each function is one step of the retraining pipeline. The ``dspark train|eval|calibrate|profile-sps``
verbs and the Prefect flows (``flows/``) both call them, so the computation lives here once. They take a
loaded target and explicit paths, write only the files they are given, and return a small frozen
dataclass (:class:`TrainSummary`, :class:`CalibrationSummary`, :class:`EvalSummary`,
:class:`LosslessSummary`, :class:`ProfileSummary`). Each has ``to_dict()`` for JSON (a flow's persisted
task result, the CLI's ``--json``) and ``from_dict()`` to read that JSON back.

:class:`Budget` holds every size knob of one retraining run, with named presets: ``default`` (the
budgets that worked in ``dspark bench --suite drafters``), ``quick`` (a three-domain retrain in minutes on
a 2-core CPU) and ``tiny`` (tests with tiny random targets).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from dspark_core.calibration import Calibration, STSConfig, fit_sts, reliability_plot
from dspark_core.data.features import FeatureStore
from dspark_core.data.traces import TraceRecord, read_jsonl
from dspark_core.drafters import (DrafterMismatchError, build_drafter, build_proposer, drafter_config, load_drafter,
                                  read_checkpoint_meta)
from dspark_core.engine.decode_one import generate
from dspark_core.engine.inputs import make_generator
from dspark_core.engine.sampling import SamplingParams
from dspark_core.pipeline.evaluate import EvalResult, SideBySide, evaluate_side_by_side, paired_ratios, speedups
from dspark_core.scheduling.sps import profile_sps, save_sps
from dspark_core.training.losses import LossConfig
from dspark_core.training.train import (FeatureSource, TrainConfig, examples_from_records, top_token_vocab,
                                        train_drafter)

log = logging.getLogger("dspark.pipeline")


@dataclass(frozen=True)
class EvalConfig:
    """How :func:`evaluate_drafter` measures a drafter: answer length, sampling temperature, tokens
    verified per round (None: the drafter's block), seed, drafter kind, and timed passes (``reps``)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    block_size: int | None = None
    seed: int = 0
    kind: str = "dspark"
    reps: int = 1


@dataclass(frozen=True)
class SPSConfig:
    """How :func:`profile_drafter` measures SPS(B): the largest verify batch B, timed repetitions, the
    context length, the drafter kind and the rows run together (None: the fewest)."""

    max_tokens: int = 16
    reps: int = 3
    context: int = 256
    kind: str = "dspark"
    rows: int | None = None


@dataclass(frozen=True)
class Budget:
    """Sizes of one retraining run (training, evaluation, calibration, SPS profiling)."""

    generic_steps: int = 700         # generic drafter on all domains (trained when none exists yet)
    steps: int = 150                 # per-domain fine-tuning (warm start)
    batch_size: int = 4
    anchors: int = 32                # blocks per sequence, generic drafter
    domain_anchors: int = 64         # ... per-domain fine-tunes: denser supervision raised held-out tau where
                                     # more data did not (docs/training.md); 64 = the drafters bench's
    lr: float = 1e-3
    block_size: int = 7
    draft_vocab: int | None = 8192   # trimmed draft vocabulary (None: the target's)
    preset: str = "default"          # drafter size preset
    max_seq_len: int = 512
    checkpoint_every: int = 50
    autocast_bf16: bool | None = None  # None: bf16 autocast where bf16 matmuls are native (TrainConfig)
    seed: int = 0
    eval_prompts: int = 8
    eval_max_new_tokens: int = 128
    eval_block_size: int = 4         # draft tokens verified per round in evaluation
    lossless_prompts: int = 3
    lossless_max_new_tokens: int = 48
    calib_prompts: int = 16
    calib_max_new_tokens: int = 128
    calib_temperature: float = 1.0
    min_rounds: int = 200            # fewer fully verified rounds keep the previous (or identity) calibration
    sps_max_tokens: int = 16
    sps_reps: int = 3
    sps_context: int = 256
    # The gate's bound on the worst per-position calibrated ECE. It belongs to the budget because the
    # calibration sample sets how small an ECE can be resolved: a few hundred rounds in 15 bins carry a
    # sampling noise of several hundredths on their own (flows: DSPARK_GATE_MAX_ECE overrides it).
    max_ece: float = 0.10

    @classmethod
    def preset_named(cls, name: str, **overrides) -> "Budget":
        presets = {"default": cls(), "quick": cls.quick(), "tiny": cls.tiny()}
        if name not in presets:
            raise ValueError(f"unknown budget {name!r}; choose one of {', '.join(presets)}")
        unknown = sorted(set(overrides) - set(asdict(presets[name])))
        if unknown:
            raise ValueError(f"unknown budget field {unknown[0]!r}; valid: {', '.join(asdict(presets[name]))}")
        return replace(presets[name], **overrides)

    @classmethod
    def quick(cls) -> "Budget":
        return cls(generic_steps=60, steps=20, checkpoint_every=20, eval_prompts=3, eval_max_new_tokens=64,
                   lossless_prompts=2, lossless_max_new_tokens=32, calib_prompts=4, calib_max_new_tokens=64,
                   min_rounds=60, sps_max_tokens=8, sps_reps=2, sps_context=128, max_ece=0.20)

    @classmethod
    def tiny(cls) -> "Budget":
        return cls(generic_steps=30, steps=20, batch_size=4, anchors=8, domain_anchors=8, block_size=4,
                   draft_vocab=None, preset="tiny", max_seq_len=128, checkpoint_every=5, autocast_bf16=False,
                   eval_prompts=3, eval_max_new_tokens=24, eval_block_size=4, lossless_prompts=2,
                   lossless_max_new_tokens=16, calib_prompts=4, calib_max_new_tokens=24, min_rounds=10,
                   sps_max_tokens=3, sps_reps=1, sps_context=16, max_ece=1.0)

    def to_dict(self) -> dict:
        return asdict(self)

    def key(self, generic: bool = False) -> str:
        """A short content hash of the fields that change what training produces (``generic``: of the
        generic drafter, which the per-domain ``steps`` and ``domain_anchors`` do not change)."""
        fields = ("generic_steps", "steps", "batch_size", "anchors", "domain_anchors", "lr", "block_size",
                  "draft_vocab", "preset", "max_seq_len", "autocast_bf16", "seed")
        return stable_key({k: getattr(self, k) for k in fields
                           if not (generic and k in ("steps", "domain_anchors"))})

    def train_config(self, steps: int, fine_tune: bool = False) -> TrainConfig:
        anchors = self.domain_anchors if fine_tune else self.anchors
        return TrainConfig(steps=steps, batch_size=self.batch_size, anchors_per_seq=anchors, lr=self.lr,
                           max_seq_len=self.max_seq_len, seed=self.seed, checkpoint_every=self.checkpoint_every,
                           autocast_bf16=self.autocast_bf16, loss=LossConfig.preset("dspark"))

    def eval_config(self) -> EvalConfig:
        """Greedy evaluation of a DSpark drafter at this budget's size."""
        return EvalConfig(max_new_tokens=self.eval_max_new_tokens, temperature=0.0, block_size=self.eval_block_size,
                          seed=self.seed)

    def sps_config(self) -> SPSConfig:
        return SPSConfig(max_tokens=self.sps_max_tokens, reps=self.sps_reps, context=self.sps_context)


def stable_key(obj, n: int = 12) -> str:
    """sha256 of the canonical JSON of ``obj``, first ``n`` hex chars (deterministic across processes)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


# ------------------------------------------------------------------------------------------ data
def read_records(path: Path) -> list[TraceRecord]:
    """All records of a trace JSONL file (a snapshot written from the warehouse, or a landing file)."""
    return [rec for _, rec in read_jsonl(Path(path))]


def heldout_prompts(records: list[TraceRecord], n: int) -> list[list[int]]:
    """Prompt token ids of the first ``n`` records with distinct prompts."""
    seen, out = set(), []
    for r in records:
        if r.prompt_id not in seen and len(out) < n:
            seen.add(r.prompt_id)
            out.append(list(r.prompt_ids))
    return out


def examples_from_snapshots(paths: list[Path | str]):
    """Training examples (prompt + completion, loss on the completion) from trace JSONL files."""
    return examples_from_records([r for p in paths for r in read_records(Path(p))])


def checkpoint_digest(folder: Path) -> str:
    """sha256 of a checkpoint's weights file: identifies what a drafter computes, wherever it lies."""
    h = hashlib.sha256()
    with (Path(folder) / "model.safetensors").open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_drafter_target(folder: Path, target_fingerprint: str) -> dict:
    """The checkpoint's metadata, after checking it was trained for this target (else
    :class:`~dspark_core.drafters.DrafterMismatchError`: it must never be evaluated, registered or promoted
    as a drafter of this target)."""
    meta = read_checkpoint_meta(Path(folder))
    if meta.get("target_fingerprint") != target_fingerprint:
        raise DrafterMismatchError(
            f"refused: drafter {folder} was trained for target {str(meta.get('target_fingerprint'))[:12]}, not for "
            f"the pipeline's target {target_fingerprint[:12]}; retrain it against this target")
    return meta


# -------------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class TrainSummary:
    """One training run: the checkpoint folder, the steps it reached, the step it started at (a resumed
    run starts past 0), its wall time, the examples it saw and the last step's scalar metrics (``loss``,
    ``tau_expected``, ...)."""

    checkpoint: str
    steps: int
    resumed_from: int
    seconds: float
    examples: int
    final: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSummary":
        return cls(**d)


def build_model(target, examples, kind: str = "dspark", preset: str = "default", block_size: int | None = None,
                draft_vocab: int | None = None, seed: int = 0, init: Path | None = None):
    """A fresh drafter (vocabulary trimmed to the examples' most frequent tokens when ``draft_vocab``) or a
    warm start from the checkpoint ``init``, which must hold the same kind of drafter for this target."""
    if init is not None:
        model = load_drafter(Path(init), target.runner, target.fingerprint)
        if model.cfg.kind != kind:
            raise ValueError(f"warm start {init} holds a {model.cfg.kind} drafter, not {kind}")
        return model
    overrides = {}
    if block_size:
        overrides["block_size"] = block_size
    if draft_vocab and draft_vocab < target.runner.arch.vocab_size:
        overrides["draft_vocab_size"] = draft_vocab
    cfg = drafter_config(kind, target.runner.arch, preset, **overrides)
    model = build_drafter(cfg, target.runner, seed=seed)
    if model.head.trimmed:
        model.head.set_vocab(top_token_vocab(examples, model.head.size, cfg.vocab_size, target.stop_token_ids))
    return model


# Eleven parameters: what is trained (target, examples, cfg, kind or model) and where (out_dir), then
# train_drafter's own options, keyword-only and passed through unchanged.
def in_vocab(examples: list, vocab: int) -> list:
    """The examples whose token ids all lie in the target's vocabulary: a trace that slipped past ingest
    with foreign ids is left out (and logged), never a crash in the middle of a retrain."""
    kept = [e for e in examples if not e.token_ids or 0 <= min(e.token_ids) and max(e.token_ids) < vocab]
    if len(kept) < len(examples):
        log.warning("left out %d training sequence(s) with token ids outside the target's vocabulary of %d",
                    len(examples) - len(kept), vocab)
    return kept


def train_domain(target, examples, out_dir: Path, cfg, kind: str = "dspark", model=None,
                 callback: Callable[[int, dict], None] | None = None, *, resume: bool = True, progress: bool = True,
                 extra_meta: dict | None = None, features=None) -> TrainSummary:
    """Train ``model`` (default: a fresh drafter) on ``examples`` into ``out_dir``, resuming from its train
    state when there is one (bit-exact). ``features``: a :class:`~dspark_core.training.train.FeatureSource`
    to read the target features from."""
    out_dir = Path(out_dir)
    examples = in_vocab(examples, target.runner.arch.vocab_size)
    if model is None:
        model = build_model(target, examples, kind)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = train_drafter(target.runner, model, examples, cfg, out_dir, target.fingerprint, callback, resume=resume,
                        progress=progress, extra_meta=extra_meta, features=features)
    last = res.history[-1] if res.history else {}
    final = {k: v for k, v in (res.final_metrics or last).items() if not isinstance(v, list)}
    return TrainSummary(checkpoint=str(out_dir), steps=res.steps, resumed_from=res.resumed_from,
                        seconds=round(res.seconds, 2), examples=len(examples), final=final)


def train_with_budget(target, examples, out_dir: Path, budget: Budget, steps: int, init: Path | None = None,
                      extra_meta: dict | None = None, home: Path | None = None) -> TrainSummary:
    """:func:`train_domain` of a DSpark drafter sized by ``budget``: fresh, or warm-started from ``init``.
    ``home``: read the target features bootstrap stored there (:mod:`dspark_core.data.features`) for the
    sequences it has; the target computes the rest (traces from serving)."""
    examples = in_vocab(examples, target.runner.arch.vocab_size)
    model = build_model(target, examples, "dspark", budget.preset, budget.block_size, budget.draft_vocab,
                        budget.seed, Path(init) if init else None)
    meta = {"budget": budget.key(), "init": str(init) if init else None, **(extra_meta or {})}
    cfg = budget.train_config(steps, fine_tune=init is not None)
    return train_domain(target, examples, out_dir, cfg, "dspark", model,
                        extra_meta=meta, features=stored_features(target, model, home))


def stored_features(target, model, home: Path | None) -> FeatureSource | None:
    """A :class:`~dspark_core.training.train.FeatureSource` for ``model``'s tap layers that reads the feature store
    under ``home`` when there is one, else None (training computes every sequence's features)."""
    if home is None:
        return None
    store = FeatureStore.for_target(Path(home), target.fingerprint)
    if not store.root.exists():
        return None
    return FeatureSource(target.runner, tuple(model.cfg.target_layer_ids), store=store)


# ----------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class CalibrationSummary:
    """One STS fit: the calibration JSON and its reliability plot, the fully verified rounds it was fitted
    on, the per-position temperatures and shifts, whether it fell back to the previous (or identity)
    calibration for want of rounds, and per-position ECE before / after and AUROC."""

    calibration: str
    plot: str
    rounds: int
    temperatures: list[float]
    shifts: list[float]
    fallback: bool
    ece_raw: list[float]
    ece_calibrated: list[float]
    auroc: list[float]

    @property
    def worst_ece_raw(self) -> float:
        return max(self.ece_raw)

    @property
    def worst_ece_calibrated(self) -> float:
        return max(self.ece_calibrated)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CalibrationSummary":
        return cls(**d)


def collect_rounds(runner, proposer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   stop_ids: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Run held-out prompts with full-block verification; return conf logits [N, G] and accepted [N]."""
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    confs, accepted = [], []
    G = proposer.max_block
    for i, ids in enumerate(prompts):
        res = generate(runner, ids, params, proposer, generator=make_generator(seed + i, runner.device),
                       record_rounds=True)
        for rd in res.stats.round_log:
            c = rd["confidence_logits"]
            if c is not None and rd["full_verify"] and len(c) == G:
                confs.append(c)
                accepted.append(rd["accepted"])
    if not confs:
        raise ValueError("no fully verified rounds with confidences were collected; calibration needs a DSpark "
                         "drafter (it has a confidence head) and held-out prompts")
    return torch.tensor(confs), torch.tensor(accepted)


def calibrate_drafter(target, checkpoint: Path, prompts: list[list[int]], out: Path, max_new_tokens: int = 128,
                      temperature: float = 1.0, min_rounds: int = 200, seed: int = 0) -> CalibrationSummary:
    """Fit STS on fully verified rounds of ``prompts``; write ``out`` (JSON) and its reliability plot
    (``out`` with ``.png``). A calibration already at ``out`` is the fallback when rounds are too few."""
    if not prompts:
        raise ValueError("calibration needs at least one held-out prompt")
    prop = build_proposer("dspark", target.runner, target.fingerprint, Path(checkpoint))
    conf, acc = collect_rounds(target.runner, prop, prompts, max_new_tokens, temperature,
                               target.stop_token_ids, seed)
    out = Path(out)
    previous = Calibration.from_dict(json.loads(out.read_text())) if out.exists() else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # the fallback is reported in the summary
        cal = fit_sts(conf, acc, STSConfig(min_rounds=min_rounds, shift=True), previous)
    cal.drafter, cal.target_fingerprint = str(checkpoint), target.fingerprint
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cal.to_dict(), indent=2))
    reliability_plot(conf, acc, cal, out.with_suffix(".png"))
    return CalibrationSummary(calibration=str(out), plot=str(out.with_suffix(".png")), rounds=cal.rounds,
                              temperatures=cal.temperatures, shifts=cal.shifts, fallback=cal.fallback,
                              ece_raw=[m["ece"] for m in cal.raw], ece_calibrated=[m["ece"] for m in cal.calibrated],
                              auroc=[m["auroc"] for m in cal.raw])


# ------------------------------------------------------------------------------------ evaluation
@dataclass(frozen=True)
class DrafterEval:
    """One drafter's held-out figures (:meth:`EvalResult.to_dict <dspark_core.pipeline.evaluate.EvalResult.to_dict>`)
    and its speedup over the plain engine measured in the same run; ``speedup_range``: the speedup's 5-95 %
    range over paired resamples of the prompts (:func:`~dspark_core.pipeline.evaluate.paired_ratios`), where
    it was computed."""

    drafter: str
    temperature: float
    prompts: int
    tau: float
    tau_median_prompt: float
    acceptance_per_position: list[float]
    tokens: int
    seconds: float
    tok_s: float
    round_ms: dict[str, float] | None
    speedup: float
    speedup_range: list[float] | None = None

    @classmethod
    def of(cls, result: EvalResult, speedup: float, speedup_range: list[float] | None = None) -> "DrafterEval":
        return cls(**result.to_dict(), speedup=speedup, speedup_range=speedup_range)

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.speedup_range is None:       # a result persisted before ranges existed reads back unchanged
            del out["speedup_range"]
        return out


@dataclass(frozen=True)
class EvalSummary:
    """A drafter's held-out evaluation, the plain engine's tok/s it was compared with and, when asked for,
    the baseline drafter (e.g. the champion) measured in the same interleaved run, with ``versus``: the
    drafter ÷ the baseline, tau and speed, each with its range over paired resamples of the prompts.

    ``to_dict()`` is flat: the drafter's figures, ``plain_tok_s`` and, with a baseline, ``baseline`` (its
    figures plus ``checkpoint``) and ``versus``."""

    drafter: DrafterEval
    plain_tok_s: float
    baseline: DrafterEval | None = None
    baseline_checkpoint: str | None = None
    versus: dict | None = None

    def to_dict(self) -> dict:
        out = {**self.drafter.to_dict(), "plain_tok_s": self.plain_tok_s}
        if self.baseline is not None:
            out["baseline"] = {**self.baseline.to_dict(), "checkpoint": self.baseline_checkpoint}
        if self.versus is not None:
            out["versus"] = self.versus
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "EvalSummary":
        d = dict(d)
        plain, base, versus = d.pop("plain_tok_s"), d.pop("baseline", None), d.pop("versus", None)
        if base is None:
            return cls(DrafterEval(**d), plain)
        base = dict(base)
        checkpoint = base.pop("checkpoint")
        return cls(DrafterEval(**d), plain, DrafterEval(**base), checkpoint, versus)


def _range(ratio: dict) -> list[float]:
    return [ratio["low"], ratio["high"]]


def evaluate_drafter(target, checkpoint: Path | None, prompts: list[list[int]], cfg: EvalConfig = EvalConfig(),
                     baseline: Path | None = None, log=None) -> EvalSummary:
    """Held-out tau, acceptance per position and speedup over the plain engine, measured side by side
    (``cfg.reps`` timed passes in rotated order, each prompt's median time: see ``evaluate_side_by_side``),
    the speedup with its range over paired resamples of the prompts.

    With ``baseline`` (e.g. the current champion's checkpoint), it is measured in the same interleaved run,
    so both face the same prompts and machine noise, and ``versus`` holds the drafter ÷ the baseline."""
    against = {} if baseline is None else {"baseline": (cfg.kind, Path(baseline))}
    res = compare_drafters(target, checkpoint, prompts, cfg, against, log=log)
    if baseline is None:
        return EvalSummary(res.drafter, res.plain_tok_s)
    return EvalSummary(res.drafter, res.plain_tok_s, res.others["baseline"], str(baseline), res.versus["baseline"])


@dataclass(frozen=True)
class Comparison:
    """A drafter and others measured in one interleaved run (:func:`compare_drafters`): each one's figures
    (with its speedup range) and, per other, ``versus[name]``: the drafter ÷ that one, tau and speed, with
    ranges (:func:`~dspark_core.pipeline.evaluate.paired_ratios`)."""

    drafter: DrafterEval
    plain_tok_s: float
    others: dict[str, DrafterEval]
    versus: dict[str, dict]

    def to_dict(self) -> dict:
        return {**self.drafter.to_dict(), "plain_tok_s": self.plain_tok_s,
                "against": {k: {**v.to_dict(), "versus": self.versus[k]} for k, v in self.others.items()}}


def compare_drafters(target, checkpoint: Path | None, prompts: list[list[int]], cfg: EvalConfig,
                     against: dict[str, tuple[str, Path | None]], log=None) -> Comparison:
    """The ``cfg.kind`` drafter at ``checkpoint`` and every ``against`` entry (name -> (kind, checkpoint);
    a checkpoint of None: a model-free kind such as ``ngram``, or ``dspark-lookup`` over ``checkpoint``),
    next to the plain engine, interleaved prompt by prompt on the same prompts and seeds. Every speedup
    and every ratio to the drafter comes with its 5-95 % range over paired resamples of the prompts."""
    if not prompts:
        raise ValueError("evaluation needs at least one held-out prompt")
    kind = cfg.kind
    if kind in against or "none" in against:
        raise ValueError(f"an evaluated drafter cannot be named {kind!r} or 'none' twice")

    def build(k: str, ckpt: Path | None):
        if ckpt is None and k == "dspark-lookup":
            ckpt = checkpoint
        return build_proposer(k, target.runner, target.fingerprint, Path(ckpt) if ckpt else None, cfg.block_size,
                              cfg.seed)

    props = {"none": None, kind: build(kind, checkpoint), **{n: build(k, c) for n, (k, c) in against.items()}}
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            stop_token_ids=target.stop_token_ids)
    res = evaluate_side_by_side(target.runner, props, prompts,
                                SideBySide(params, cfg.seed, block_size=cfg.block_size, reps=cfg.reps), log=log)
    sp = speedups(res)

    def figures(name: str) -> DrafterEval:
        speed = paired_ratios(res, name, "none", seed=cfg.seed)["speed_ratio"]
        return DrafterEval.of(res[name], sp[name], _range(speed))

    return Comparison(figures(kind), round(res["none"].tok_s, 3), {n: figures(n) for n in against},
                      {n: paired_ratios(res, kind, n, seed=cfg.seed) for n in against})


@dataclass(frozen=True)
class LosslessSummary:
    """The lossless check: prompts run, how many differed from plain greedy decoding (and which), and the
    target dtype it ran in."""

    prompts: int
    failures: int
    failed_prompts: list[int]
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LosslessSummary":
        return cls(**d)


def lossless_check(target, checkpoint: Path, prompts: list[list[int]], max_new_tokens: int = 48,
                   block_size: int | None = None) -> LosslessSummary:
    """Greedy speculative output must equal plain greedy output token for token. Run it on a float32
    target: there it is exact (in bf16 a multi-token verify can round a near-tie differently)."""
    prop = build_proposer("dspark", target.runner, target.fingerprint, Path(checkpoint), block_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=target.stop_token_ids)
    failed = [i for i, ids in enumerate(prompts)
              if generate(target.runner, ids, params, None).token_ids
              != generate(target.runner, ids, params, prop, block_size).token_ids]
    return LosslessSummary(prompts=len(prompts), failures=len(failed), failed_prompts=failed,
                           dtype=str(target.runner.dtype).replace("torch.", ""))


# ----------------------------------------------------------------------------------------- SPS(B)
@dataclass(frozen=True)
class ProfileSummary:
    """One SPS(B) profile: its JSON and plot paths, the table (steps/s for B = 1, 2, ...) and wall time."""

    sps: str
    plot: str
    table: list[float]
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ProfileSummary":
        return cls(**d)


def profile_drafter(target, checkpoint: Path | None, out: Path, cfg: SPSConfig = SPSConfig(),
                    log=None) -> ProfileSummary:
    """Measure SPS(B) with this drafter's draft cost and write ``out`` (JSON) plus its plot (``.png``)."""
    prop = build_proposer(cfg.kind, target.runner, target.fingerprint, Path(checkpoint) if checkpoint else None)
    block = prop.max_block if prop is not None else 7
    t0 = time.perf_counter()
    prof = profile_sps(target.runner, prop, cfg.max_tokens, cfg.reps, cfg.context, block, log=log, rows=cfg.rows)
    prof["target_fingerprint"] = target.fingerprint
    save_sps(prof, Path(out))
    return ProfileSummary(sps=str(out), plot=str(Path(out).with_suffix(".png")), table=prof["sps"],
                          seconds=round(time.perf_counter() - t0, 2))
