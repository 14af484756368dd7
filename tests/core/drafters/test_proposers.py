import json

import pytest
import torch

from dspark_core.drafters import (DrafterMismatchError, build_drafter, build_proposer, drafter_config,
                                   load_drafter, save_drafter)
from dspark_core.drafters.modules import default_tap_layers
from dspark_core.drafters.ngram import ngram_lookup
from dspark_core.engine.sampling import SamplingParams
from tiny_models import tiny_target


def test_ngram_lookup_prefers_longest_most_recent_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_lookup(seq, 3, max_n=3, min_n=1) == [7, 5, 1]     # most recent earlier [1, 2, 3]
    assert ngram_lookup([4, 5, 6], 2, 3, 1) == []
    assert ngram_lookup([8, 1, 8], 2, 2, 1) == [1, 8]


def test_default_taps_are_spread_and_skip_the_final_layer():
    assert default_tap_layers(30, 5) == (1, 8, 14, 20, 27)
    assert default_tap_layers(36, 5) == (1, 9, 17, 25, 33)        # matches the DSpark Qwen3-4B choice
    for n in range(2, 12):
        taps = default_tap_layers(n, 5)
        assert all(-1 <= t <= n - 2 for t in taps) and list(taps) == sorted(set(taps))


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_checkpoint_round_trip_reproduces_drafts(kind, tmp_path):
    target = tiny_target("llama", vocab=64, seed=2)
    r = target.runner
    model = build_drafter(drafter_config(kind, r.arch, "tiny"), r, seed=7)
    save_drafter(model, tmp_path / kind, target.fingerprint, extra={"note": "test"})
    meta = json.loads((tmp_path / kind / "config.json").read_text())
    assert meta["target_fingerprint"] == target.fingerprint and meta["config"]["kind"] == kind
    a = build_proposer(kind, r, target.fingerprint, tmp_path / kind)
    b = build_proposer(kind, r, target.fingerprint, None, seed=7, preset="tiny")
    out = r.forward(r.new_cache(1, 64), torch.tensor([[3, 4, 5, 6]]), taps=a.tap_layers)
    params = SamplingParams()
    da = a.propose(a.start([3, 4, 5, 6], out.taps[0]), 9, 4, params, None)
    db = b.propose(b.start([3, 4, 5, 6], out.taps[0]), 9, 4, params, None)
    assert da.tokens.tolist() == db.tokens.tolist()


def test_fresh_drafters_are_seeded():
    target = tiny_target("llama", vocab=64)
    r = target.runner
    w = lambda seed: build_drafter(drafter_config("dspark", r.arch, "tiny"), r, seed).fc.weight
    assert torch.equal(w(1), w(1)) and not torch.equal(w(1), w(2))


def test_wrong_fingerprint_checkpoint_is_refused(tmp_path):
    target = tiny_target("llama", vocab=64, seed=2)
    other = tiny_target("llama", vocab=64, seed=3)
    model = build_drafter(drafter_config("dspark", target.runner.arch, "tiny"), target.runner)
    save_drafter(model, tmp_path / "ck", target.fingerprint)
    with pytest.raises(DrafterMismatchError, match="trained for target"):
        load_drafter(tmp_path / "ck", other.runner, other.fingerprint)
    with pytest.raises(DrafterMismatchError, match="not dflash"):
        build_proposer("dflash", target.runner, target.fingerprint, tmp_path / "ck")


def test_unknown_kind_and_oversized_block_are_explained(tmp_path):
    target = tiny_target("llama", vocab=64)
    with pytest.raises(ValueError, match="unknown drafter"):
        build_proposer("medusa", target.runner, target.fingerprint)
    model = build_drafter(drafter_config("dspark", target.runner.arch, "tiny", block_size=3), target.runner)
    save_drafter(model, tmp_path / "ck", target.fingerprint)
    with pytest.raises(ValueError, match="trained block size 3"):
        build_proposer("dspark", target.runner, target.fingerprint, tmp_path / "ck", block_size=5)
    with pytest.raises(FileNotFoundError, match="not a drafter checkpoint"):
        build_proposer("dspark", target.runner, target.fingerprint, tmp_path / "missing")


def test_dspark_returns_confidences_and_exact_draft_probs():
    target = tiny_target("llama", vocab=64, seed=2)
    r = target.runner
    p = build_proposer("dspark", r, target.fingerprint, preset="tiny", block_size=5)
    out = r.forward(r.new_cache(1, 64), torch.tensor([[3, 4, 5, 6]]), taps=p.tap_layers)
    gen = torch.Generator().manual_seed(0)
    d = p.propose(p.start([3, 4, 5, 6], out.taps[0]), 9, 5, SamplingParams(temperature=1.0), gen)
    assert d.tokens.shape == (5,) and d.draft_probs.shape == (5, 64) and d.confidence_logits.shape == (5,)
    assert torch.allclose(d.draft_probs.sum(-1), torch.ones(5))
    assert (d.draft_probs[torch.arange(5), d.tokens] > 0).all()


def test_lookup_first_copies_a_repeat_and_asks_the_drafter_otherwise():
    """dspark-lookup: a suffix of >= 2 tokens seen before -> the copy (one-hot, confidences from the copies'
    observed acceptance, the drafter not run); no such repeat -> the DSpark drafter's own draft, confidences
    included; the drafter's context follows every committed token either way, so its drafts equal a plain
    DSpark proposer's fed the same commits."""
    from tiny_models import tiny_target
    from dspark_core.drafters import build_proposer
    from dspark_core.engine.sampling import SamplingParams
    target = tiny_target("llama", vocab=64, seed=3)
    runner = target.runner
    hybrid = build_proposer("dspark-lookup", runner, target.fingerprint, block_size=4, preset="tiny")
    plain = build_proposer("dspark", runner, target.fingerprint, block_size=4, preset="tiny")
    assert hybrid.tap_layers == plain.tap_layers and hybrid.max_block == 4
    prompt = [5, 9, 11, 7, 5, 9, 11, 20, 21]
    cache = runner.new_cache(1, 64)
    out = runner.forward(cache, torch.tensor([prompt]), taps=plain.tap_layers, logits="last")
    hs, ps = hybrid.start(prompt, out.taps[0]), plain.start(prompt, out.taps[0])
    params = SamplingParams()
    copy = hybrid.propose(hs, 5, 4, params, None)            # suffix [21, 5] never seen before
    assert copy.confidence_logits is not None                # -> the drafter drafted
    own = plain.propose(ps, 5, 4, params, None)
    assert torch.equal(copy.tokens, own.tokens)
    # commit "5 9" (as if the anchor 5 and a draft 9 were accepted): suffix [5, 9] + anchor 11 -> repeat
    step = runner.forward(cache, torch.tensor([[5, 9]]), taps=plain.tap_layers, logits="none")
    for prop, st in ((hybrid, hs), (plain, ps)):
        prop.commit(st, [5, 9], step.taps[0])
    hit = hybrid.propose(hs, 11, 4, params, None)             # [5, 9, 11] occurred: copy what followed
    assert hit.tokens.tolist() == [20, 21, 5, 9] and hit.draft_probs is None
    # the copy's confidences: no copy has met the target yet, so the Beta(1, 1) prior (logit 0) at every
    # position, already calibrated (no drafter calibration applies to them)
    assert hit.calibrated and hit.confidence_logits.tolist() == [0.0] * 4 and hit.truncate(2).calibrated
    assert hybrid.lookups == 1 and hybrid.model_drafts == 1
    # no repeat again: the drafter, which absorbed the skipped round's context late, drafts as plain DSpark
    step = runner.forward(cache, torch.tensor([[11, 30]]), taps=plain.tap_layers, logits="none")
    for prop, st in ((hybrid, hs), (plain, ps)):
        prop.commit(st, [11, 30], step.taps[0])
    mixed = hybrid.propose_batch([hs], [40], [3], [params], [None])[0]
    assert torch.equal(mixed.tokens, plain.propose(ps, 40, 3, params, None).tokens)
    # the copy [20, 21, 5, 9] met the target: one token accepted, then the target chose 40 (the anchor),
    # not 21: position 0 reached and accepted, position 1 reached and refused, later ones not reached
    assert hybrid.copy_reached[:3] == [1, 1, 0] and hybrid.copy_accepted[:3] == [1, 0, 0]
    p = torch.sigmoid(hybrid.copy_confidence(3))
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 1 / 2]))
