"""Training recipes: the configuration the scaling suite found best, trained for as long as it pays.

A recipe fixes the drafter (kind and the :class:`~dspark_core.drafters.modules.DrafterConfig` overrides), the
loss mix and the training settings, and trains with a long learning-rate schedule, scoring held-out tau
(teacher-forced, :func:`~dspark_core.training.train.teacher_forced_eval`, on every held-out sequence of the
trained domains) every ``eval_every`` steps. It keeps the best checkpoint so far in ``<out>/best`` and
stops:

- on a **plateau**: ``patience`` scores in a row without a gain of ``min_gain`` (relative) over the best;
- at ``max_steps``;
- at the end of a **leg**: no further stretch of ``eval_every`` steps starts once ``leg_minutes`` have passed.
  The folder keeps the train state and the score history (``recipe.json``); the same call resumes it
  bit-exactly, so a long recipe runs in legs of a working session each.

A recipe **fine-tunes** too (:meth:`Recipe.fine_tune`): a per-domain run warm-starts from a recipe checkpoint
(the generic run's ``best``) on a short schedule with denser blocks, scoring the domain's held-out sequences. It
scores the starting point first (step 0), so its ``best`` is never worse than the checkpoint it began from.

``recipe.json`` also records the recipe itself: a folder started with one recipe refuses to resume under
another (start over with ``resume=False``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from dspark_core.drafters import save_drafter
from dspark_core.training.losses import LossConfig
from dspark_core.training.train import Example, FeatureSource, TrainConfig, teacher_forced_eval, train_drafter

STATE_FILE = "recipe.json"
BEST = "best"


@dataclass(frozen=True)
class Recipe:
    """One training recipe. ``drafter`` and ``loss`` override the kind's defaults (``drafter_config`` and
    ``LossConfig.preset``)."""

    name: str
    kind: str = "dspark"
    drafter: dict = field(default_factory=dict)
    loss: dict = field(default_factory=dict)
    max_steps: int = 6000            # the learning-rate schedule's length; a plateau usually stops it sooner
    batch_size: int = 4
    anchors: int = 32
    lr: float = 1e-3
    eval_every: int = 300
    patience: int = 3                # scores in a row without a gain of min_gain end the run
    min_gain: float = 0.005          # relative to the best held-out tau so far
    metric: str = "tau_greedy"       # "tau_greedy" (serving's default decoding) or "tau_expected" (T = 1)
    # blocks scored per held-out sequence: 128 is every position of a bootstrap trace (128 new tokens), so a
    # score depends on the checkpoint alone. At 32, three anchor draws scored one code checkpoint 2.19 / 2.21 /
    # 2.24 (greedy) against 2.15 over every position, and ranked two checkpoints 0.04-0.06 apart that read
    # 0.007 apart over every position (docs/training.md)
    eval_anchors: int = 128
    seed: int = 0
    init: str | None = None          # a fine-tune: the checkpoint it warm-starts from (:meth:`fine_tune`)
    # a fine-tune's schedule: shorter, denser blocks per sequence (one domain has fewer sequences), scored
    # more often; the per-domain fine-tunes of the drafters bench train 500-900 steps at 64 anchors
    fine_tune_steps: int = 1200
    fine_tune_anchors: int = 64
    fine_tune_eval_every: int = 150
    # from a drafter trained to its plateau, 1e-3 first undoes held-out code tau (2.18 -> 2.05 after 150
    # steps) where 3e-4 keeps it (2.18) and lifts math (2.63 -> 2.66 after 300): docs/training.md
    fine_tune_lr: float = 3e-4

    def fine_tune(self, init: str | Path) -> "Recipe":
        """This recipe as a fine-tune from the checkpoint ``init``."""
        return replace(self, init=str(init), max_steps=self.fine_tune_steps, anchors=self.fine_tune_anchors,
                       eval_every=self.fine_tune_eval_every, lr=self.fine_tune_lr)

    def loss_config(self) -> LossConfig:
        return replace(LossConfig.preset(self.kind), **self.loss)

    def train_config(self) -> TrainConfig:
        return TrainConfig(steps=self.max_steps, batch_size=self.batch_size, anchors_per_seq=self.anchors,
                           lr=self.lr, seed=self.seed, checkpoint_every=self.eval_every, loss=self.loss_config())

    def to_dict(self) -> dict:
        return asdict(self)


RECIPES = {
    # What the scaling suite (`dspark bench --suite scaling`, docs/training.md) measured best at one budget:
    # the paper's Markov rank (256: slots 2+ gain) with half the loss on hard CE (slot 1 gains, greedy
    # decoding follows the argmax); the draft vocabulary and block size are the bench's.
    "reference": Recipe("reference", drafter={"markov_rank": 256, "block_size": 5, "draft_vocab_size": 8192},
                        loss={"alpha_ce": 0.5, "alpha_tv": 0.5}),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


@dataclass
class RecipeState:
    """What ``recipe.json`` holds: the recipe, every score, the best one and why the run stopped."""

    recipe: dict
    scores: list[dict] = field(default_factory=list)     # {"step", "tau_greedy", "tau_expected", per domain}
    best: dict | None = None                             # the best score's entry
    status: str = "new"          # new | leg-ended | plateau | max-steps
    legs: int = 0
    train_seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return self.status in ("plateau", "max-steps")

    def to_dict(self) -> dict:
        return asdict(self)


def read_state(out: Path) -> RecipeState | None:
    p = Path(out) / STATE_FILE
    if not p.exists():
        return None
    return RecipeState(**json.loads(p.read_text()))


def _write_state(out: Path, state: RecipeState) -> None:
    p = Path(out) / STATE_FILE
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_dict(), indent=2))
    tmp.replace(p)


def score_heldout(runner, model, heldout: dict[str, list[Example]], features: FeatureSource | None,
                  anchors: int, seed: int) -> dict:
    """Teacher-forced tau on each domain's held-out examples and the mean over domains (greedy and T = 1)."""
    per = {}
    for d, ex in heldout.items():
        r = teacher_forced_eval(runner, model, ex, features, anchors_per_seq=anchors, seed=seed)
        per[d] = {"tau_greedy": round(r["tau_greedy"], 4), "tau_expected": round(r["tau_expected"], 4),
                  "blocks": r["blocks"]}
    mean = {m: round(sum(v[m] for v in per.values()) / len(per), 4) for m in ("tau_greedy", "tau_expected")}
    return {**mean, "domains": per}


def _plateaued(state: RecipeState, recipe: Recipe) -> bool:
    """``patience`` scores in a row, the latest ones, none beating the best before them by ``min_gain``."""
    s = state.scores
    if len(s) <= recipe.patience:
        return False
    before = max(x[recipe.metric] for x in s[:-recipe.patience])
    return all(x[recipe.metric] < before * (1 + recipe.min_gain) for x in s[-recipe.patience:])


def run_recipe(target, model, examples: list[Example], heldout: dict[str, list[Example]], out: Path,
               recipe: Recipe, *, leg_minutes: float = 85.0, features: FeatureSource | None = None,
               resume: bool = True, progress: bool = True, extra_meta: dict | None = None,
               log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic) -> RecipeState:
    """Train ``model`` (fresh, built for ``recipe``) on ``examples`` by ``recipe`` into ``out`` for one leg
    of at most ``leg_minutes`` (the stretch under way when the time runs out finishes first), scoring on
    ``heldout`` (domain -> examples, none of them trained on) every ``recipe.eval_every`` steps. Returns the
    state written to ``out/recipe.json``; ``out/best`` holds the best-scoring checkpoint."""
    out = Path(out)
    if not heldout or not any(heldout.values()):
        raise ValueError("a recipe needs held-out examples to score (dspark traces bootstrap keeps a held-out split)")
    heldout = {d: ex for d, ex in heldout.items() if ex}
    state = read_state(out) if resume else None
    if state is not None and state.recipe != recipe.to_dict():
        raise ValueError(f"{out} holds a run of another recipe ({state.recipe.get('name')}, other settings); "
                         "use another folder or start over")
    if state is None:
        if out.exists() and not resume:
            for f in ("train_state.pt", STATE_FILE):
                (out / f).unlink(missing_ok=True)
        state = RecipeState(recipe=recipe.to_dict())
    if state.finished:
        log(f"recipe {recipe.name}: {out} already finished ({state.status}); best at step {state.best['step']}")
        return state
    out.mkdir(parents=True, exist_ok=True)
    cfg = recipe.train_config()
    deadline = clock() + 60 * leg_minutes
    if recipe.init is not None and not state.scores:
        # a fine-tune scores where it starts: best/ is the start until a step beats it
        sc = score_heldout(target.runner, model, heldout, features, recipe.eval_anchors, recipe.seed)
        state.scores = [{"step": 0, **sc, "train_loss": None, "train_seconds": 0.0}]
        state.best = state.scores[0]
        model.train()
        save_drafter(model, out / BEST, target.fingerprint,
                     extra={"recipe": recipe.to_dict(), "step": 0, "heldout": sc, **(extra_meta or {})})
        log(f"recipe {recipe.name} fine-tune from {recipe.init}: held-out tau greedy {sc['tau_greedy']:.3f}, "
            f"T = 1 {sc['tau_expected']:.3f} at the start")
        _write_state(out, state)
    mark = [clock()]                 # when the current stretch (training, then its score) began
    state.legs += 1
    stopped = {"why": None}

    def on_step(step: int, metrics: dict) -> None:
        if step % recipe.eval_every and step != cfg.steps:
            return
        began = mark[0]
        state.train_seconds = round(state.train_seconds + clock() - began, 1)
        sc = score_heldout(target.runner, model, heldout, features, recipe.eval_anchors, recipe.seed)
        model.train()
        entry = {"step": step, **sc, "train_loss": round(metrics.get("loss", 0.0), 4),
                 "train_seconds": state.train_seconds}
        # a run killed between its score and its checkpoint scores that step again on resume
        state.scores = [x for x in state.scores if x["step"] < step] + [entry]
        state.best = max(state.scores, key=lambda x: (x[recipe.metric], -x["step"]))    # ties: the earlier
        if state.best is entry:
            save_drafter(model, out / BEST, target.fingerprint,
                         extra={"recipe": recipe.to_dict(), "step": step, "heldout": sc, **(extra_meta or {})})
        log(f"recipe {recipe.name} step {step}: held-out tau greedy {sc['tau_greedy']:.3f}, T = 1 "
            f"{sc['tau_expected']:.3f} (best {state.best[recipe.metric]:.3f} at step {state.best['step']})")
        now = clock()
        if step >= cfg.steps:
            stopped["why"] = "max-steps"
        elif _plateaued(state, recipe):
            stopped["why"] = "plateau"
        elif now + (now - began) > deadline:          # the next stretch, as long as this one, would overrun
            stopped["why"] = "leg-ended"
        _write_state(out, state)
        mark[0] = clock()

    train_drafter(target.runner, model, examples, cfg, out, target.fingerprint, on_step, resume=resume,
                  progress=progress, features=features, extra_meta={"recipe": recipe.name, **(extra_meta or {})},
                  stop=lambda step: stopped["why"] is not None)
    state.status = stopped["why"] or "max-steps"
    _write_state(out, state)
    return state
