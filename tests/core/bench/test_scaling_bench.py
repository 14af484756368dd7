"""The scaling suite's machinery on a tiny target: teacher-forced scores, nested data subsets, cached and
resumable jobs, the time budget that splits the suite into legs."""

import hashlib
import json

import pytest
import torch

from dspark_core.bench.scaling import ABLATIONS, Job, ScalingConfig, _subset, render_markdown, scaling_suite
from dspark_core.data.bootstrap import BootstrapConfig, bootstrap_traces
from dspark_core.drafters import build_drafter, drafter_config
from dspark_core.training.train import Example, teacher_forced_eval
from tiny_models import tiny_target

VOCAB = 64


def _encode(text: str) -> list[int]:
    return [1 + b % (VOCAB - 1) for b in hashlib.sha1(text.encode()).digest()[:6]]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab=VOCAB, layers=2, seed=4)


def test_teacher_forced_eval_is_deterministic_and_bounded(target):
    gen = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(1, VOCAB, (30,), generator=gen).tolist(), 8) for _ in range(5)]
    model = build_drafter(drafter_config("dspark", target.runner.arch, "tiny", block_size=4), target.runner, seed=1)
    model.train()
    a = teacher_forced_eval(target.runner, model, examples, anchors_per_seq=6, seed=3)
    assert model.training                                              # the caller's mode is restored
    b = teacher_forced_eval(target.runner, model, examples, anchors_per_seq=6, seed=3)
    assert a == b and a["sequences"] == 5 and a["blocks"] > 0
    assert 1.0 <= a["tau_greedy"] <= 5.0 and 1.0 <= a["tau_expected"] <= 5.0
    assert len(a["accept_per_pos"]) == len(a["greedy_per_pos"]) == 4
    assert all(0.0 <= x <= 1.0 for x in a["accept_per_pos"] + a["greedy_per_pos"])
    with pytest.raises(ValueError, match="at least 2 response tokens"):
        teacher_forced_eval(target.runner, model, [Example([1, 2, 3], 2)])


def test_subsets_are_nested():
    ex = [Example([i, i + 1, i + 2], 1) for i in range(50)]
    small, big = _subset(ex, 0.1, 0), _subset(ex, 0.3, 0)
    assert len(small) == 5 and len(big) == 15 and all(e in big for e in small)


def test_the_suite_runs_caches_resumes_and_stops_at_its_budget(target, tmp_path, capsys):
    home = tmp_path / "home"
    bootstrap_traces(target, home, BootstrapConfig(("code", "math"), per_domain=10, batch_size=5, max_new_tokens=12,
                                                   heldout_fraction=0.3), encode=_encode, progress=False)
    cfg = ScalingConfig(kinds=("dspark", "dflash"), fractions=(0.5, 1.0), steps=2, milestones=2, batch_size=2,
                        anchors=4, block_size=3, draft_vocab=0, eval_sequences=2, eval_anchors=4,
                        ablations=(ABLATIONS[0],), domains=("code", "math"), smoke=True)
    logs = []
    res = scaling_suite(target, cfg, home, log=logs.append)
    assert res["complete"] and not res["pending"]
    assert set(res["jobs"]) == {"dspark-0.5", "dspark-1", "dflash-0.5", "dflash-1", "markov-off"}
    job = res["jobs"]["dspark-1"]
    assert sorted(job["scores"]) == ["1", "2"] and {"code", "math", "train"} <= set(job["scores"]["2"])
    assert res["jobs"]["dspark-0.5"]["train_sequences"] < job["train_sequences"]
    assert set(res["ratios"]["1"]) == {"dspark_vs_dflash"} and "markov-off" in res["ablation_delta_vs_baseline"]
    slots = res["final"]["dspark-1"]["greedy_per_slot"]                 # block 3: slots 1..3, each a rate
    assert len(slots) == 3 and all(0.0 <= x <= 1.0 for x in slots)
    text = render_markdown({**res, "meta": {}})
    assert "| run | slot 1 | slot 2 | slot 3 |" in text and f"| dspark-1 | {slots[0]:.3f} |" in text
    # a second run reuses every finished job
    logs.clear()
    again = scaling_suite(target, cfg, home, log=logs.append)
    assert again["final"] == res["final"] and all("running" not in line for line in logs)
    # a budget that is spent starts nothing new: those jobs are pending, the finished ones still report
    more = ScalingConfig(**{**cfg.__dict__, "ablations": (ABLATIONS[0], Job("layers-3", "dspark",
                                                                              drafter=(("num_layers", 3),))),
                            "budget_minutes": 1e-9})
    leg = scaling_suite(target, more, home, log=logs.append)
    assert leg["pending"] == ["layers-3"] and not leg["complete"] and "dspark-1" in leg["jobs"]
    json.dumps(leg)                                                   # the result is plain JSON
    # ``only`` narrows a leg to the named jobs: the others stay pending, finished ones still report
    narrowed = scaling_suite(target, ScalingConfig(**{**more.__dict__, "budget_minutes": 85.0, "only": ("dflash-1",)}),
                             home, log=logs.append)
    assert narrowed["pending"] == ["layers-3"] and "dspark-1" in narrowed["jobs"]


def test_the_cli_refuses_unknown_domains_and_too_few_steps_and_the_report_names_them(tmp_path):
    from dspark_core.cli.bench import _run_scaling
    from dspark_core.cli.common import CliError, Settings
    from dspark_core.cli.main import build_parser

    parse = lambda *extra: build_parser().parse_args(["bench", "--suite", "scaling", *extra])  # noqa: E731
    with pytest.raises(CliError, match="--domains: unknown domain prose"):
        _run_scaling(parse("--domains", "code,prose"), Settings(tmp_path))
    with pytest.raises(CliError, match="--steps must be at least"):
        _run_scaling(parse("--steps", "2"), Settings(tmp_path))
    # a leg narrowed by --jobs: what it left out is not "pending" for its own command to finish
    text = render_markdown({"config": {"steps": 2400, "domains": ["code"], "only": ["dspark-1"]}, "final": {},
                            "jobs": {}, "pending": ["dspark-1", "layers-3"]})
    assert text.startswith("Every run trains 2400 steps on the code traces and is scored on its held-out")
    assert "Pending (rerun the command to go on): dspark-1." in text
    assert "Not run by this command (name them with --jobs): layers-3." in text
