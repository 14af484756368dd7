"""The fused batch-1 drafting pass (BlockPlan) computes what the drafter's modules compute."""

import pytest
import torch

from dspark_core.drafters import BlockProposer, build_drafter, drafter_config
from dspark_core.engine.sampling import SamplingParams
from tiny_models import tiny_target


def _setup(kind, family="llama", G=4, trimmed=0, context_input=False, seed=0, **layout):
    target = tiny_target(family, vocab=64, seed=7)
    r = target.runner
    model = build_drafter(drafter_config(kind, r.arch, "tiny", block_size=G, draft_vocab_size=trimmed,
                                         context_input=context_input, **layout), r, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.3)
    if trimmed:
        model.head.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(3))[:trimmed].sort().values)
    tokens = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    out = r.forward(r.new_cache(1, 48), tokens, taps=tuple(model.cfg.target_layer_ids), logits="none")
    return model, tokens[0], out.taps[0].clone()


@torch.no_grad()
def _reference(model, taps, anchor, k):
    """The drafting pass through the modules, whole context at once: h [G, d], base logits, greedy
    Markov drafts (target ids) and confidence logits."""
    n, G = taps.shape[0], model.cfg.block_size
    ctx = model.context(taps[None])
    cos_c, sin_c = model.rope(torch.arange(n)[None])
    kv = [layer.project_kv(ctx, cos_c, sin_c, normed=not model.cfg.context_norm) for layer in model.layers]
    x = model.block_inputs(torch.tensor([anchor]), ctx[:, -1])
    cos, sin = model.rope(torch.arange(n, n + G)[None])
    h = model.backbone(x, cos, sin, [k_ for k_, _ in kv], [v for _, v in kv])[0]
    logits = model.base_logits(h[:k])
    if model.markov_in is None:
        return h, logits, model.head.to_global(logits.argmax(-1)), None
    toks, embs, prev = [], [], torch.tensor(anchor)
    for i in range(k):
        bias, emb = model.markov_bias(prev)
        prev = model.head.to_global((logits[i] + bias).argmax())
        toks.append(prev)
        embs.append(emb)
    conf = model.confidence_logit(h[:k], torch.stack(embs)) if model.confidence is not None else None
    return h, logits, torch.stack(toks), conf


LEGACY = dict(qk_norm=False, context_norm=True, mask_token_id=-1)   # the layout before the reference one


@pytest.mark.parametrize("kind,family,trimmed,context_input,layout", [
    ("dspark", "llama", 0, False, {}), ("dspark", "qwen3", 24, True, {}), ("dflash", "qwen2", 0, False, {}),
    ("dspark", "llama", 24, False, {}), ("dspark", "llama", 24, False, LEGACY), ("dflash", "qwen2", 0, False, LEGACY)])
def test_plan_matches_modules_across_rounds(kind, family, trimmed, context_input, layout):
    """Context absorbed over several commits (the block's scratch keys overwritten each round) gives the
    same hidden states, logits, drafts and confidences as the modules run over the whole context, in the
    reference layout and in the older one (checkpoints trained before it still load and draft)."""
    model, tokens, taps = _setup(kind, family, trimmed=trimmed, context_input=context_input, **layout)
    prop = BlockProposer(model)
    greedy = SamplingParams(max_new_tokens=8)
    state = prop.start(tokens[:12].tolist(), taps[:12])
    n = 12
    for step in (3, 1, 5, 2, 4):
        anchor = int(tokens[n])
        h, logits = prop.block_logits(state, anchor, 3)
        draft = prop.propose(state, anchor, 3, greedy, None)
        ref_h, ref_logits, ref_toks, ref_conf = _reference(model, taps[:n], anchor, 3)
        torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert draft.tokens.tolist() == ref_toks.tolist()
        if ref_conf is not None:
            torch.testing.assert_close(draft.confidence_logits, ref_conf, rtol=1e-5, atol=1e-5)
        prop.commit(state, tokens[n:n + step].tolist(), taps[n:n + step])
        n += step


def test_plan_follows_weight_updates():
    """An in-place update of the drafter's weights (an optimizer step, load_state_dict) is seen by the
    next draft: the fused copies are rebuilt, never stale."""
    model, tokens, taps = _setup("dspark")
    prop = BlockProposer(model)
    state = prop.start(tokens[:20].tolist(), taps[:20])
    before, _ = prop.block_logits(state, int(tokens[20]))
    first_plan = prop.plan()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    fresh = BlockProposer(model)
    after, _ = prop.block_logits(prop.start(tokens[:20].tolist(), taps[:20]), int(tokens[20]))
    want, _ = fresh.block_logits(fresh.start(tokens[:20].tolist(), taps[:20]), int(tokens[20]))
    assert prop.plan() is not first_plan
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, want, rtol=0, atol=0)
    ref_h, *_ = _reference(model, taps[:20], int(tokens[20]), 1)
    torch.testing.assert_close(after, ref_h, rtol=1e-5, atol=1e-5)


def test_plan_sampled_drafts_follow_the_generator():
    """At temperature > 0 the Markov loop draws from the same distributions with the same generator
    as the module path: same tokens, and the returned draft distributions are the ones drawn from."""
    model, tokens, taps = _setup("dspark", trimmed=24)
    prop = BlockProposer(model)
    params = SamplingParams(max_new_tokens=8, temperature=0.8)
    state = prop.start(tokens[:16].tolist(), taps[:16])
    anchor = int(tokens[16])
    draft = prop.propose(state, anchor, 4, params, torch.Generator().manual_seed(5))
    h, logits = prop.block_logits(state, anchor, 4)
    gen = torch.Generator().manual_seed(5)
    prev = torch.tensor(anchor)
    from dspark_core.engine.sampling import draw
    for i in range(4):
        bias, _ = model.markov_bias(prev)
        local, probs = draw(logits[i] + bias, params, gen)
        prev = model.head.to_global(local)
        assert int(prev) == int(draft.tokens[i])
        torch.testing.assert_close(draft.draft_probs[i], model.head.to_global_probs(probs))
    assert float(draft.draft_probs.sum(-1).sub(1).abs().max()) < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_pass_matches_modules(family):
    """propose_batch (contexts of different lengths, padded and masked) drafts what the modules give
    each row alone."""
    model, tokens, taps = _setup("dspark", family, trimmed=24, context_input=True)
    prop = BlockProposer(model)
    cuts = [9, 23, 31]
    states = [prop.start(tokens[:n].tolist(), taps[:n]) for n in cuts]
    anchors = [int(tokens[n]) for n in cuts]
    greedy = SamplingParams(max_new_tokens=8)
    drafts = prop.propose_batch(states, anchors, [3, 3, 2], [greedy] * 3, [None] * 3)
    for n, a, k, got in zip(cuts, anchors, [3, 3, 2], drafts):
        _, _, toks, conf = _reference(model, taps[:n], a, k)
        assert got.tokens.tolist() == toks.tolist()
        torch.testing.assert_close(got.confidence_logits, conf, rtol=1e-4, atol=1e-4)
