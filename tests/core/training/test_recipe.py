"""Training recipes: held-out scores on a schedule, the best checkpoint kept, a plateau or the step budget
ends the run, and a run cut into legs resumes to the same weights as one run straight through."""

from dataclasses import replace

import pytest
import torch

from dspark_core.drafters import build_drafter, drafter_config, load_drafter
from dspark_core.training.recipe import (BEST, RECIPES, Recipe, RecipeState, _plateaued, read_state, run_recipe,
                                         score_heldout)
from dspark_core.training.train import Example
from tiny_models import tiny_target

RECIPE = Recipe("t", drafter={"block_size": 3}, max_steps=8, batch_size=2, anchors=8, lr=3e-3, eval_every=2,
                patience=50, eval_anchors=8)


def _data():
    target = tiny_target("llama", vocab=64)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 64, (24,), generator=g).tolist() for _ in range(10)]
    examples = [Example(s, 6) for s in seqs]
    return target, examples[:7], {"a": examples[7:9], "b": examples[9:]}


def _model(target, recipe=RECIPE):
    return build_drafter(drafter_config("dspark", target.runner.arch, "tiny", **recipe.drafter), target.runner, seed=1)


class Clock:
    """A clock that moves only when read: each read is ``tick`` seconds after the last."""

    def __init__(self, tick: float):
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def test_legs_resume_to_the_same_weights_and_scores_as_one_run(tmp_path):
    target, train, held = _data()
    straight = _model(target)
    s1 = run_recipe(target, straight, train, held, tmp_path / "a", RECIPE, progress=False, log=lambda m: None)
    assert s1.status == "max-steps" and [x["step"] for x in s1.scores] == [2, 4, 6, 8] and s1.legs == 1

    # legs of "one minute" on a clock that advances 5 s per read: each leg ends after one scored stretch
    legs, model = [], None
    for _ in range(10):
        model = _model(target)
        st = run_recipe(target, model, train, held, tmp_path / "b", RECIPE, leg_minutes=1 / 60 * 12,
                        progress=False, log=lambda m: None, clock=Clock(5.0))
        legs.append(st.status)
        if st.finished:
            break
    assert legs[-1] == "max-steps" and "leg-ended" in legs and len(legs) > 1
    assert read_state(tmp_path / "b").legs == len(legs)
    for (name, a), (_, b) in zip(straight.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    assert [(x["step"], x["tau_greedy"], x["tau_expected"]) for x in st.scores] == \
        [(x["step"], x["tau_greedy"], x["tau_expected"]) for x in s1.scores]
    # a finished run is not trained again
    again = run_recipe(target, _model(target), train, held, tmp_path / "b", RECIPE, progress=False, log=lambda m: None)
    assert again.legs == st.legs and again.status == "max-steps"


def test_the_best_score_is_kept_as_a_loadable_checkpoint(tmp_path):
    target, train, held = _data()
    st = run_recipe(target, _model(target), train, held, tmp_path, RECIPE, progress=False, log=lambda m: None)
    best = max(st.scores, key=lambda x: (x["tau_greedy"], -x["step"]))
    assert st.best == best and set(best["domains"]) == {"a", "b"}
    loaded = load_drafter(tmp_path / BEST, target.runner, target.fingerprint)
    import json
    meta = json.loads((tmp_path / BEST / "config.json").read_text())
    assert meta["step"] == best["step"] and meta["recipe"]["name"] == "t"
    assert loaded.cfg.block_size == 3


def test_a_plateau_ends_the_run_before_the_step_budget(tmp_path):
    target, train, held = _data()
    recipe = replace(RECIPE, patience=1, min_gain=10.0)        # no score can gain 1000 %: stop at the second
    st = run_recipe(target, _model(target, recipe), train, held, tmp_path, recipe, progress=False,
                    log=lambda m: None)
    assert st.status == "plateau" and [x["step"] for x in st.scores] == [2, 4]
    assert torch.load(tmp_path / "train_state.pt", weights_only=False)["step"] == 4


def test_plateau_rule():
    r = replace(RECIPE, patience=2, min_gain=0.01)
    st = RecipeState(recipe={}, scores=[{"tau_greedy": t} for t in (1.0, 1.5, 1.51, 1.505)])
    assert _plateaued(st, r)                                     # 1.51 < 1.5 * 1.01
    st.scores.append({"tau_greedy": 1.6})
    assert not _plateaued(st, r)
    assert not _plateaued(RecipeState(recipe={}, scores=[{"tau_greedy": 1.0}] * 2), r)   # too few scores


def test_another_recipe_in_the_same_folder_and_no_heldout_are_clear_errors(tmp_path):
    target, train, held = _data()
    run_recipe(target, _model(target), train, held, tmp_path, replace(RECIPE, max_steps=2), progress=False,
               log=lambda m: None)
    with pytest.raises(ValueError, match="another recipe"):
        run_recipe(target, _model(target), train, held, tmp_path, RECIPE, progress=False, log=lambda m: None)
    st = run_recipe(target, _model(target), train, held, tmp_path, RECIPE, resume=False, progress=False,
                    log=lambda m: None)                          # started over
    assert st.status == "max-steps" and st.legs == 1
    with pytest.raises(ValueError, match="held-out"):
        run_recipe(target, _model(target), train, {"a": []}, tmp_path / "x", RECIPE, progress=False)


def test_the_reference_recipe_is_the_scaling_suites_best_configuration():
    from dspark_core.bench.scaling import ABLATIONS
    r = RECIPES["reference"]
    best = {j.name: j for j in ABLATIONS}["rank-256-ce-0.5"]
    assert {**r.drafter, **dict(best.drafter)} == r.drafter
    assert {**r.loss, **dict(best.loss)} == r.loss


def test_a_fine_tune_scores_its_start_and_never_keeps_worse(tmp_path):
    target, train, held = _data()
    run_recipe(target, _model(target), train, held, tmp_path / "generic", RECIPE, progress=False, log=lambda m: None)
    init = tmp_path / "generic" / BEST
    ft = replace(RECIPE, fine_tune_steps=4, fine_tune_anchors=4, fine_tune_eval_every=2).fine_tune(init)
    assert (ft.init, ft.max_steps, ft.anchors, ft.eval_every, ft.lr) == (str(init), 4, 4, 2, RECIPE.fine_tune_lr)
    start = load_drafter(init, target.runner, target.fingerprint)
    st = run_recipe(target, load_drafter(init, target.runner, target.fingerprint), train, {"a": held["a"]},
                    tmp_path / "ft", ft, progress=False, log=lambda m: None)
    assert [x["step"] for x in st.scores] == [0, 2, 4] and set(st.scores[0]["domains"]) == {"a"}
    assert st.best["tau_greedy"] >= st.scores[0]["tau_greedy"]
    kept = load_drafter(tmp_path / "ft" / BEST, target.runner, target.fingerprint)
    if st.best["step"] == 0:                    # nothing beat the start: best/ is the start, weight for weight
        for (name, a), (_, b) in zip(start.state_dict().items(), kept.state_dict().items()):
            assert torch.equal(a, b), name
    # the start is scored once, not again when a later leg resumes the run
    again = run_recipe(target, load_drafter(init, target.runner, target.fingerprint), train, {"a": held["a"]},
                       tmp_path / "ft", ft, progress=False, log=lambda m: None)
    assert [x["step"] for x in again.scores] == [0, 2, 4]
    # a fine-tune folder refuses a fine-tune from another checkpoint
    with pytest.raises(ValueError, match="another recipe"):
        run_recipe(target, load_drafter(init, target.runner, target.fingerprint), train, {"a": held["a"]},
                   tmp_path / "ft", ft.fine_tune(tmp_path / "elsewhere"), progress=False, log=lambda m: None)


def test_a_fine_tune_that_gains_nothing_keeps_its_start(tmp_path):
    target, train, held = _data()
    run_recipe(target, _model(target), train, held, tmp_path / "generic", RECIPE, progress=False, log=lambda m: None)
    init = tmp_path / "generic" / BEST
    # a zero learning rate: every score ties the start's, and a tie goes to the earlier step
    ft = replace(RECIPE, fine_tune_lr=0.0, fine_tune_steps=2, fine_tune_anchors=4, fine_tune_eval_every=2).fine_tune(init)
    st = run_recipe(target, load_drafter(init, target.runner, target.fingerprint), train, held, tmp_path / "ft",
                    ft, progress=False, log=lambda m: None)
    assert st.best["step"] == 0 and st.scores[1]["tau_greedy"] == st.scores[0]["tau_greedy"]
    import json
    assert json.loads((tmp_path / "ft" / BEST / "config.json").read_text())["step"] == 0


def test_a_recipe_scores_every_position_of_a_bootstrap_length_trace():
    """Held-out sequences with 100 response tokens: the default recipe scores a block at every position, so
    its score is the same whatever the anchor seed; 32 anchors per sequence (a sample) move with the seed."""
    target = tiny_target("llama", vocab=64)
    g = torch.Generator().manual_seed(4)
    held = {"a": [Example(torch.randint(3, 64, (106,), generator=g).tolist(), 6) for _ in range(3)]}
    model = _model(target)
    every = [score_heldout(target.runner, model, held, None, Recipe("x").eval_anchors, seed) for seed in (0, 5)]
    assert every[0] == every[1] and every[0]["domains"]["a"]["blocks"] == 3 * 99
    sampled = [score_heldout(target.runner, model, held, None, 32, seed) for seed in (0, 5)]
    assert sampled[0]["domains"]["a"]["blocks"] == 3 * 32
    assert sampled[0]["tau_expected"] != sampled[1]["tau_expected"]
