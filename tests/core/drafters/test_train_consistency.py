"""The training passes compute exactly what the inference proposers compute for the same context."""

import pytest
import torch

from dspark_core.drafters import BlockProposer, Eagle3Proposer, build_drafter, drafter_config
from dspark_core.drafters.block import block_train_forward
from dspark_core.drafters.eagle3 import eagle3_train_forward
from tiny_models import tiny_target


def _setup(kind, G=4, seed=0):
    target = tiny_target("llama", vocab=64, seed=7)
    r = target.runner
    model = build_drafter(drafter_config(kind, r.arch, "tiny", block_size=G), r, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.3)
    tokens = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    out = r.forward(r.new_cache(1, 40), tokens, taps=tuple(model.cfg.target_layer_ids), logits="none")
    return r, model, tokens, out.taps


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_block_training_pass_matches_inference(kind):
    G = 4
    r, model, tokens, taps = _setup(kind, G)
    anchors = torch.tensor([[5, 11, 20]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        logits, conf = block_train_forward(model, taps, tokens, anchors, keep)
    prop = BlockProposer(model)
    for j, a in enumerate(anchors[0].tolist()):
        state = prop.start(tokens[0, :a].tolist(), taps[0, :a])
        h, base = prop.block_logits(state, int(tokens[0, a]))
        expect = base
        if model.markov_in is not None:       # teacher-forced previous tokens: anchor, y1, y2, ...
            prev = tokens[0, a:a + G]
            expect = base + model.markov_bias(prev)[0]
        torch.testing.assert_close(logits[0, j], expect, rtol=1e-4, atol=1e-4)


def test_block_training_pass_with_gradient_and_bf16_autocast():
    """With a gradient recorded the logits stay in the matmul's dtype and the Markov bias is accumulated
    into them (one addmm): the same values as the no-gradient pass, and the Markov head gets a gradient."""
    r, model, tokens, taps = _setup("dspark", 4)
    taps = taps.clone()                         # the runner's output is an inference tensor; training reads copies
    anchors = torch.tensor([[5, 11, 20]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        ref, _ = block_train_forward(model, taps, tokens, anchors, keep)
    logits, _ = block_train_forward(model, taps, tokens, anchors, keep)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    logits.square().sum().backward()
    assert model.markov_out.weight.grad is not None and model.markov_out.weight.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = block_train_forward(model, taps, tokens, anchors, keep)
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() <= 0.03 * ref.abs().max()


def test_eagle3_training_pass_matches_inference_chain():
    G = 3
    r, model, tokens, taps = _setup("eagle3", G)
    anchors = torch.tensor([[6, 14]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        logits = eagle3_train_forward(model, taps, tokens, anchors, keep, G)
    prop = Eagle3Proposer(model)
    for j, a in enumerate(anchors[0].tolist()):
        # Inference with the true continuation as "draft": feed tokens through the proposer's own steps.
        state = prop.start(tokens[0, :a].tolist(), taps[0, :a])
        d = prop.drafter
        seq = tokens[0].tolist()
        with torch.no_grad():
            feats = d.features(taps[:, :a])
            nxt = torch.tensor(seq[1:a + 1])[None]
            out = prop._run(state, d.step_inputs(nxt, feats), 0)
            last = out[:, -1:]
            torch.testing.assert_close(logits[0, j, 0], d.logits(last)[0, 0], rtol=1e-4, atol=1e-4)
            for i in range(1, G):
                last = prop._run(state, d.step_inputs(torch.tensor([[seq[a + i]]]), last), a - 1 + i)
                torch.testing.assert_close(logits[0, j, i], d.logits(last)[0, 0], rtol=1e-4, atol=1e-4)
