"""The drafters bench's checkpoint cache: reused at the same budget (steps and anchors), retrained (not
resumed) at another."""

import json

import torch
from safetensors.torch import load_file

from dspark_core.bench.drafters import DraftersBenchConfig, TrainJob, _train
from dspark_core.training.train import Example
from tiny_models import tiny_target


def _small_setup():
    """A tiny learnable target, eight random training sequences and a small bench budget."""
    target = tiny_target("llama", vocab=64, seed=5, init=0.5, local=True)
    gen = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(0, 64, (24,), generator=gen).tolist(), 6) for _ in range(8)]
    return target, examples, DraftersBenchConfig(batch_size=2, anchors=4, block_size=3, draft_vocab=32)


def test_a_cached_checkpoint_of_another_step_budget_is_retrained_from_its_start(tmp_path):
    target, examples, cfg = _small_setup()
    out, logs = tmp_path / "dspark-code", []

    def history():
        return [h["step"] for h in json.loads((out / "history.json").read_text())]
    _train(target, TrainJob("dspark", 4, out), examples, cfg, logs.append)
    assert history() == [1, 2, 3, 4]
    _train(target, TrainJob("dspark", 4, out), examples, cfg, logs.append)          # same budget: reused
    assert any("reusing" in m for m in logs) and history() == [1, 2, 3, 4]
    info = _train(target, TrainJob("dspark", 6, out), examples, cfg, logs.append)   # another budget: from step 0
    assert any("trained for 4 steps x 4 anchors, not 6 x 4" in m for m in logs)
    assert history() == [1, 2, 3, 4, 5, 6] and info["steps"] == 6
    meta = json.loads((out / "config.json").read_text())
    assert meta["train"]["steps"] == 6 and meta["step"] == 6
    # the same weights as six steps trained in one go (a resume from step 4 would have run the first four
    # on a 4-step learning-rate schedule)
    _train(target, TrainJob("dspark", 6, tmp_path / "straight"), examples, cfg, logs.append)
    a = load_file(str(out / "model.safetensors"))
    b = load_file(str(tmp_path / "straight" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_cached_fine_tune_with_other_anchors_per_sequence_is_retrained(tmp_path):
    """The per-domain fine-tunes sample more anchors per sequence than the generic drafters: a cached
    fine-tune of the same step count but another anchor count is trained again, with the anchors asked for."""
    target, examples, cfg = _small_setup()
    out, logs = tmp_path / "dspark-code", []
    _train(target, TrainJob("dspark", 3, out), examples, cfg, logs.append)
    info = _train(target, TrainJob("dspark", 3, out, anchors=8), examples, cfg, logs.append)
    assert any("trained for 3 steps x 4 anchors, not 3 x 8" in m for m in logs)
    assert info["anchors"] == 8 and json.loads((out / "config.json").read_text())["train"]["anchors_per_seq"] == 8
    _train(target, TrainJob("dspark", 3, out, anchors=8), examples, cfg, logs.append)
    assert logs[-1].startswith("[drafters] reusing")


def test_the_scheduled_column_is_opt_in_and_the_table_and_checks_follow_the_evaluated_drafters():
    from dspark_core.bench.drafters import _checks, render_markdown
    full, quick = DraftersBenchConfig(), DraftersBenchConfig.quick()
    assert "dspark-sched" not in full.drafters() and "dspark-sched" in quick.drafters()
    assert set(full.drafters()) >= {"dspark", "dspark-generic", "dflash", "eagle3", "ngram"}
    assert full.steps_for("code") == 900 and full.steps_for("legal") == full.domain_steps
    assert {quick.steps_for(d) for d in ("chat", "code", "math")} == {quick.domain_steps}
    tau = {"code": {k: 1.0 + i / 10 for i, k in enumerate(full.drafters())}}
    speed = {"code": {k: 1.5 for k in full.drafters()}}
    checks = _checks(tau, speed)["code"]
    assert "dspark_sched_faster_than_plain" not in checks and checks["dspark_faster_than_plain"]
    md = render_markdown({"tau": tau, "speedup": speed})
    assert "dspark-sched" not in md and md.splitlines()[0].count("|") == len(full.drafters()) + 3
    with_sched = {"code": {**tau["code"], "dspark-sched": 0.9}}
    speed_s = {"code": {**speed["code"], "dspark-sched": 0.9}}
    assert _checks(with_sched, speed_s)["code"]["dspark_sched_faster_than_plain"] is False
    assert "dspark-sched" in render_markdown({"tau": with_sched, "speedup": speed_s})


def test_mined_code_prompts_are_opt_in_and_key_their_own_checkpoints(capsys, tmp_path, monkeypatch):
    """``--code-mined N`` adds stdlib stubs to the code domain's training data: off in the full run (they
    lengthen the bootstrap without raising held-out code tau), on in the smoke run so the path is exercised;
    a run with them keeps its checkpoints apart, and a run without them keys its checkpoints as if the
    option did not exist. A negative N is refused before anything is loaded."""
    from dataclasses import replace
    from dspark_core.cli.main import main
    full, quick = DraftersBenchConfig(), DraftersBenchConfig.quick()
    assert full.code_mined == 0 and quick.code_mined > 0
    assert replace(full, code_mined=400).train_key() != full.train_key()
    assert replace(full, code_mined=400, domains=("chat", "math")).train_key() == replace(
        full, domains=("chat", "math")).train_key()
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    assert main(["bench", "--suite", "drafters", "--code-mined", "-1"]) == 2
    assert "--code-mined must be >= 0" in capsys.readouterr().err


def test_a_cached_checkpoint_of_another_architecture_is_retrained(tmp_path):
    """A checkpoint trained for the same budget by code that built another architecture (the older block
    layout, say) is not reused: the bench measures the drafter this code builds."""
    target, examples, cfg = _small_setup()
    out, logs = tmp_path / "dspark-code", []
    _train(target, TrainJob("dspark", 3, out), examples, cfg, logs.append)
    meta = json.loads((out / "config.json").read_text())
    meta["config"].update(qk_norm=False, context_norm=True, mask_token_id=-1)
    (out / "config.json").write_text(json.dumps(meta))
    _train(target, TrainJob("dspark", 3, out), examples, cfg, logs.append)
    assert any("holds another architecture (context_norm, mask_token_id, qk_norm)" in m for m in logs)
    assert not logs[-1].startswith("[drafters] reusing")
    assert json.loads((out / "config.json").read_text())["config"]["context_norm"] is False


def test_teacher_forced_tau_scores_every_heldout_sequence_of_every_trained_drafter(tmp_path, monkeypatch):
    """Each trained checkpoint, the recipe's among them, is scored teacher-forced on all of a domain's held-out
    sequences, greedy and at T = 1; the table and the ratio checks carry them."""
    from dspark_core.bench import drafters
    target, examples, cfg = _small_setup()
    root = tmp_path / "root"
    for name in ("dspark-generic", "dflash-generic", "eagle3-generic", "dspark-code"):
        kind = name.split("-")[0]
        _train(target, TrainJob(kind, 2, root / name), examples, cfg, lambda m: None)
    _train(target, TrainJob("dspark", 3, tmp_path / "recipe" / "best"), examples, cfg, lambda m: None)
    _train(target, TrainJob("dspark", 2, tmp_path / "tuned" / "best"), examples, cfg, lambda m: None)
    cfg = DraftersBenchConfig(domains=("code",), batch_size=2, anchors=4, block_size=3, draft_vocab=32,
                              reference=str(tmp_path / "recipe" / "best"), tf_anchors=4,
                              reference_domain=(("code", str(tmp_path / "tuned" / "best")),))
    held = examples[:5]
    monkeypatch.setattr(drafters, "heldout_records", lambda home, d, fp: ["r"] * len(held))
    monkeypatch.setattr(drafters, "examples_from_records", lambda recs: held[:len(recs)])
    logs = []
    tf = drafters._teacher_forced(target, cfg, tmp_path, root, None, logs.append)["code"]
    assert tf["sequences"] == 5 and tf["tokens"] == sum(len(e.token_ids) - e.response_start for e in held)
    assert set(tf) - {"sequences", "tokens"} == set(drafters.TRAINED)
    for k in drafters.TRAINED:
        assert 1 <= tf[k]["greedy"] <= 4 and 1 <= tf[k]["t1"] <= 4 and tf[k]["blocks"] > 0
    assert "dspark-reference" in cfg.drafters() and "dspark-reference" not in DraftersBenchConfig().drafters()
    tau = {"code": {k: 1.5 for k in cfg.drafters()}}
    speed = {"code": {k: 1.2 for k in cfg.drafters()}}
    checks = drafters._checks(tau, speed, {"code": tf})["code"]
    assert checks["tf_t1_ratio_vs_dflash"] == round(tf["dspark-generic"]["t1"] / tf["dflash"]["t1"], 3)
    assert checks["reference_speedup_goal"] == 2.0 and checks["reference_meets_speedup_goal"] is False
    assert checks["reference_vs_ngram_speedup"] == 1.0
    assert checks["reference_domain_speedup_goal"] == 2.0 and checks["tau_ratio_reference_domain_vs_reference"] == 1.0
    md = drafters.render_markdown({"tau": tau, "speedup": speed, "tau_teacher_forced": {"code": tf}})
    row = next(line for line in md.splitlines() if "teacher-forced" in line)
    assert "5 held-out sequences" in row and row.count("–") == 2      # dspark-lookup and ngram are not trained
    assert drafters._checkpoints(root, "code", cfg)["dspark-reference-domain"] == tmp_path / "tuned" / "best"
    assert "dspark-reference-domain" not in drafters._checkpoints(root, "chat", cfg)
    # a recipe run's scores come along with its checkpoint
    (tmp_path / "recipe" / "recipe.json").write_text(json.dumps(
        {"recipe": {"name": "reference"}, "status": "leg-ended", "legs": 1, "train_seconds": 600.0,
         "scores": [{"step": 300, "tau_greedy": 1.4, "tau_expected": 1.3, "domains": {}}]}))
    info = drafters._reference_info(tmp_path / "recipe" / "best")
    assert info["recipe"] == "reference" and info["step"] == 3 and info["scores"][0]["step"] == 300
    md = drafters.render_markdown({"tau": tau, "speedup": speed, "reference": info})
    assert "recipe's best checkpoint (step 3; the run is leg-ended after 1 leg(s), 10 min" in md
    assert drafters._reference_info(root / "dflash-generic") == {"checkpoint": str(root / "dflash-generic"), "step": 2}


def test_a_per_domain_reference_is_evaluated_on_its_domain_only_and_rendered_where_it_ran():
    from dspark_core.bench import drafters
    cfg = DraftersBenchConfig(reference="/r/best", reference_domain=(("code", "/c/best"),))
    assert "dspark-reference-domain" in cfg.drafters_for("code")
    assert "dspark-reference-domain" not in cfg.drafters_for("chat") and "dspark-reference" in cfg.drafters_for("chat")
    tau = {d: {k: 1.5 for k in cfg.drafters_for(d)} for d in ("chat", "code")}
    tau["code"]["dspark-reference-domain"] = 1.8
    speed = {d: {k: 1.2 for k in cfg.drafters_for(d)} for d in ("chat", "code")}
    checks = drafters._checks(tau, speed)
    assert checks["code"]["tau_ratio_reference_domain_vs_reference"] == 1.2
    assert "reference_domain_speedup_goal" not in checks["chat"]
    info = {"code": {"checkpoint": "/c/best", "step": 450, "status": "plateau",
                     "scores": [{"step": 0, "tau_greedy": 2.1, "tau_expected": 1.9},
                                {"step": 450, "tau_greedy": 2.4, "tau_expected": 2.1}]}}
    md = drafters.render_markdown({"tau": tau, "speedup": speed, "reference_domain": info})
    assert "code: step 450 of 450 (plateau), held-out teacher-forced tau greedy 2.100 at the start, 2.400 at best" in md
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in md.splitlines() if line.startswith("| c")}
    header = next(line for line in md.splitlines() if line.startswith("| domain"))
    col = [c.strip() for c in header.split("|")].index("dspark-reference-domain")
    assert [c.strip() for c in rows[("chat", "tau")].split("|")][col] == "–"
    assert [c.strip() for c in rows[("code", "tau")].split("|")][col] == "1.80"
    assert [c.strip() for c in rows[("code", "speedup")].split("|")][col] == "1.20x"


def test_bad_reference_domain_arguments_are_refused_before_anything_loads(capsys, tmp_path, monkeypatch):
    from dspark_core.cli.main import main
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    for args, says in ((["code"], "is not DOMAIN=DIR"),
                       (["code=/a", "code=/b"], "names code twice"),
                       (["poetry=/a"], "measures chat, code, math, not 'poetry'"),
                       ([f"code={tmp_path}"], "holds no drafter checkpoint")):
        argv = ["bench", "--suite", "drafters"] + [x for a in args for x in ("--reference-domain", a)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and "hint:" in err and "Traceback" not in err


def test_the_evaluation_reports_speedup_ranges_and_the_named_ratios_over_paired_prompts(tmp_path, monkeypatch):
    """Every decoded drafter's speedup comes with its 5-95 % range over paired resamples of the prompts, and
    ``versus`` holds the ratios the goals name (DSpark ÷ DFlash / Eagle3-style / lookup) with ranges; the
    table shows both. ``--prompts`` sets how many held-out prompts are decoded; 0 is refused up front."""
    from dspark_core.bench import drafters
    from dspark_core.engine.stats import AcceptanceStats
    from dspark_core.pipeline.evaluate import EvalResult
    cfg = DraftersBenchConfig(domains=("code",), eval_prompts=6, eval_reps=1)
    seen = {}

    def fake_side_by_side(runner, props, prompts, how, scheduled=None, log=None):
        seen["prompts"] = len(prompts)
        out = {}
        for j, name in enumerate(props):
            res = EvalResult(name, 0.0)
            for i in range(len(prompts)):
                res.add(AcceptanceStats(rounds=10, emitted=10 + j + i % 3, wall_seconds=1.0 + 0.1 * (i % 2)), 20 + j)
            out[name] = res
        return out
    monkeypatch.setattr(drafters, "evaluate_side_by_side", fake_side_by_side)
    monkeypatch.setattr(drafters, "_proposers", lambda target, root, d, c: {k: None for k in ("none", *c.drafters())})

    class Rec:
        prompt_ids = [1, 2]
    monkeypatch.setattr(drafters, "heldout_records", lambda home, d, fp: [Rec()] * 9)

    class T:
        runner, fingerprint, stop_token_ids = None, "fp", ()
    ev = drafters._evaluate(T(), cfg, tmp_path, tmp_path, log=lambda *_: None)
    assert seen["prompts"] == 6
    for k, (lo, hi) in ev["speedup_range"]["code"].items():
        assert lo <= ev["speedup"]["code"][k] <= hi
    v = ev["versus"]["code"]
    assert {"dspark-generic / dflash", "dspark-generic / eagle3", "dspark / ngram"} <= set(v)
    assert v["dspark / ngram"]["prompts"] == 6
    md = drafters.render_markdown(ev)
    assert "| code | speedup (5-95 %) |" in md and "| code | dspark / ngram |" in md
    assert "Ranges: 5-95 % over paired resamples of the decoded prompts." in md
    from dspark_core.cli.main import main
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    assert main(["bench", "--suite", "drafters", "--prompts", "0"]) == 2
