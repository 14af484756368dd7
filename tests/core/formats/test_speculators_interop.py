"""Export to and import from vllm-project/speculators, proven against the real package (0.9.0): its own
loader reads our folder with nothing missing or unexpected and computes our logits and confidences; a
folder its own ``save_pretrained`` wrote imports and drafts the same tokens."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_core.drafters import BlockProposer, build_drafter, drafter_config
from dspark_core.drafters.block import block_train_forward
from dspark_core.drafters.checkpoint import DrafterMismatchError, load_drafter, save_drafter
from dspark_core.engine.sampling import SamplingParams
from dspark_core.formats import FormatError, export_drafter, import_drafter
from dspark_core.pipeline.steps import build_model
from dspark_core.training.train import Example, TrainConfig, train_drafter
from tiny_models import tiny_target

from speculators import SpeculatorModel   # installed by make install (--no-deps, see the Makefile)
from speculators.models.attention import create_float_mask

G, VD, S = 4, 24, 28


def _randomise(module, seed, skip=()):
    """Every trained weight random and distinct (norm gains around 1), so a swapped or dropped name shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(s in name for s in skip):
                continue
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def _target(family, tmp_path):
    target = tiny_target(family, vocab=64, seed=7, layers=5)
    folder = tmp_path / f"verifier-{family}"
    target.reference.save_pretrained(folder)
    return replace(target, path=folder)


def _our_drafter(target, kind="dspark", trimmed=VD, seed=1):
    r = target.runner
    model = build_drafter(drafter_config(kind, r.arch, "tiny", block_size=G, draft_vocab_size=trimmed,
                                         num_layers=2), r, seed=seed)
    _randomise(model, seed)
    if trimmed:   # an unsorted draft vocabulary: the export must reorder it consistently
        model.head.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(3))[:trimmed])
    return model


def _features(target):
    tokens = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(11))
    r = target.runner
    return tokens, r, tokens[0]


def _taps(target, taps, tokens):
    r = target.runner
    return r.forward(r.new_cache(1, S + 8), tokens, taps=tuple(taps), logits="none").taps.clone()


def _eager(model):
    """Their default attention is compiled flex attention (a GPU path); eager computes the same function."""
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl = "eager"
    model._create_mask_fn = create_float_mask
    return model.eval()


@torch.no_grad()
def _their_outputs(model, taps, tokens):
    """speculators' own modules, teacher-forced, every position an anchor: logits over the draft
    vocabulary with the Markov bias, and confidence logits, [A, G, Vd] and [A, G]."""
    A = S - G
    hidden, logits, _, _, idx = model._backbone_forward(
        taps, tokens, torch.ones(1, S), torch.zeros(1, S, model.hidden_size), torch.zeros(1, S, dtype=torch.long),
        max_anchors=A)
    h = hidden.view(A, G, -1)
    logits = logits.view(A, G, -1)
    conf = None
    if getattr(model, "markov_head", None) is not None:
        prev = tokens[0, idx].view(A, G)
        emb = model.markov_head.prev_embeddings(prev)
        logits = logits + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=h, prev_emb=emb)
        conf = model.confidence_head(torch.cat([h, emb], dim=-1))
    return logits, conf


@torch.no_grad()
def _their_greedy_block(model, taps, tokens, p):
    """Their drafting of the block after anchor position p: base logits from the backbone, then the Markov
    chain fed with its own drafted tokens (target ids), as vLLM drafts."""
    A = S - G
    hidden, logits, _, _, _ = model._backbone_forward(
        taps, tokens, torch.ones(1, S), torch.zeros(1, S, model.hidden_size), torch.zeros(1, S, dtype=torch.long),
        max_anchors=A)
    base = logits.view(A, G, -1)[p]
    ids = torch.arange(model.d2t.numel()) + model.d2t if model.use_draft_vocab else torch.arange(base.shape[-1])
    prev, out = tokens[0, p], []
    for k in range(G):
        z = base[k]
        if getattr(model, "markov_head", None) is not None:
            z = z + model.markov_head.markov_w2(model.markov_head.markov_w1(prev.view(1)))[0]
        prev = ids[z.argmax()]
        out.append(int(prev))
    return out


@pytest.mark.parametrize("family,kind,trimmed", [("qwen3", "dspark", VD), ("llama", "dspark", VD),
                                                 ("llama", "dspark", 0), ("qwen3", "dflash", VD)])
def test_export_loads_in_speculators_and_computes_our_function(family, kind, trimmed, tmp_path):
    target = _target(family, tmp_path)
    model = _our_drafter(target, kind, trimmed)
    ckpt = save_drafter(model, tmp_path / "ckpt", target.fingerprint)
    out = export_drafter(ckpt, target, "speculators", tmp_path / "export")

    _, info = SpeculatorModel.from_pretrained(str(out), output_loading_info=True)
    # (with output_loading_info their loader skips the verifier weights: load again to compute)
    theirs = SpeculatorModel.from_pretrained(str(out))
    assert type(theirs).__name__ == ("DSparkDraftModel" if kind == "dspark" else "DFlashDraftModel")
    assert not info["unexpected_keys"]
    # only what their loader rebuilds from the verifier may be missing (embedding, verifier head and norm)
    assert set(info["missing_keys"]) <= {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                                         "lm_head.weight" if not trimmed else "-"}
    assert theirs.target_layer_ids == [t + 1 for t in model.cfg.target_layer_ids]
    theirs = _eager(theirs.float())

    tokens, _, _ = _features(target)
    taps = _taps(target, model.cfg.target_layer_ids, tokens)
    their_logits, their_conf = _their_outputs(theirs, taps, tokens)
    ours, our_conf = block_train_forward(model.eval(), taps, tokens, torch.arange(S - G)[None],
                                         torch.ones(1, S - G, dtype=torch.bool))
    ours = ours[0]
    if trimmed:   # our draft ids in export order (ascending target id)
        ours = ours[..., torch.argsort(model.head.vocab_ids)]
    torch.testing.assert_close(their_logits, ours.float(), rtol=1e-4, atol=1e-4)
    if kind == "dspark":
        torch.testing.assert_close(their_conf, our_conf[0], rtol=1e-4, atol=1e-4)

    # batch-1 drafting: our proposer's greedy block equals theirs, anchor after anchor
    prop = BlockProposer(model)
    for p in (3, 9, 17):
        state = prop.start(tokens[0, :p].tolist(), taps[0, :p])
        draft = prop.propose(state, int(tokens[0, p]), G, SamplingParams(max_new_tokens=G), None)
        assert draft.tokens.tolist() == _their_greedy_block(theirs, taps, tokens, p)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_speculators_save_pretrained_imports_and_drafts_the_same(family, tmp_path):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    import transformers as tf

    target = _target(family, tmp_path)
    a = target.arch
    layer = tf.Qwen3Config(vocab_size=64, hidden_size=a.hidden_size, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=512)
    layer._attn_implementation = "eager"
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VD, block_size=G, aux_hidden_state_layer_ids=[1, 3, 4],
        mask_token_id=60, markov_rank=8,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=G)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target.path), architectures=["X"])))
    theirs = DSparkDraftModel(cfg)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(5))[:VD].sort().values
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[ids] = True
    theirs.load_vocab_mappings(t2d, ids - torch.arange(VD))
    theirs.load_verifier_weights()
    _randomise(theirs, 9, skip=("embed_tokens", "lm_head", "verifier"))
    theirs.save_pretrained(tmp_path / "theirs")

    report = import_drafter(tmp_path / "theirs", target, tmp_path / "imported")
    assert report.format == "speculators" and report.kind == "dspark" and report.target_check == "head rows"
    ours = load_drafter(tmp_path / "imported", target.runner, target.fingerprint)
    assert ours.cfg.target_layer_ids == (0, 2, 3) and ours.cfg.mask_token_id == 60

    theirs = _eager(theirs)
    tokens, _, _ = _features(target)
    taps = _taps(target, ours.cfg.target_layer_ids, tokens)
    their_logits, their_conf = _their_outputs(theirs, taps, tokens)
    our_logits, our_conf = block_train_forward(ours.eval(), taps, tokens, torch.arange(S - G)[None],
                                               torch.ones(1, S - G, dtype=torch.bool))
    torch.testing.assert_close(our_logits[0].float(), their_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(our_conf[0], their_conf, rtol=1e-4, atol=1e-4)
    prop = BlockProposer(ours)
    for p in (2, 11, 20):
        state = prop.start(tokens[0, :p].tolist(), taps[0, :p])
        draft = prop.propose(state, int(tokens[0, p]), G, SamplingParams(max_new_tokens=G), None)
        assert draft.tokens.tolist() == _their_greedy_block(theirs, taps, tokens, p)

    # a published drafter is a warm start: what dspark train --init does with the imported checkpoint
    warm = build_model(target, [], "dspark", init=tmp_path / "imported")
    before = {k: v.clone() for k, v in warm.state_dict().items()}
    seqs = [Example(torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(i)).tolist(), 4)
            for i in range(4)]
    res = train_drafter(target.runner, warm, seqs, TrainConfig(steps=3, batch_size=2, anchors_per_seq=4),
                        progress=False)
    assert len(res.history) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in res.history)
    assert not torch.equal(before["markov_out.weight"], warm.state_dict()["markov_out.weight"])
    assert torch.equal(before["head.vocab_ids"], warm.state_dict()["head.vocab_ids"])


def test_a_dropped_or_foreign_weight_fails_both_ways(tmp_path):
    """A converter that drops a weight is caught: their loader reports it missing, our import refuses."""
    target = _target("qwen3", tmp_path)
    ckpt = save_drafter(_our_drafter(target), tmp_path / "ckpt", target.fingerprint)
    out = export_drafter(ckpt, target, "speculators", tmp_path / "export")
    weights = load_file(str(out / "model.safetensors"))
    dropped = dict(weights)
    del dropped["layers.1.self_attn.k_norm.weight"]
    save_file(dropped, str(out / "model.safetensors"))
    _, info = SpeculatorModel.from_pretrained(str(out), output_loading_info=True)
    assert "layers.1.self_attn.k_norm.weight" in info["missing_keys"]
    with pytest.raises(FormatError, match="lacks trained weights.*layers.1.k_norm"):
        import_drafter(out, target, tmp_path / "back")
    save_file({**weights, "layers.0.self_attn.extra.weight": torch.ones(2)}, str(out / "model.safetensors"))
    with pytest.raises(FormatError, match="no place for.*extra"):
        import_drafter(out, target, tmp_path / "back")


def test_import_refuses_another_target(tmp_path):
    target = _target("qwen3", tmp_path)
    other = replace(tiny_target("qwen3", vocab=64, seed=8, layers=5), path=target.path)
    ckpt = save_drafter(_our_drafter(target), tmp_path / "ckpt", target.fingerprint)
    out = export_drafter(ckpt, target, "speculators", tmp_path / "export")
    with pytest.raises(DrafterMismatchError, match="exported for target"):
        import_drafter(out, other, tmp_path / "back")
    config = (out / "config.json").read_text().replace('"target_fingerprint"', '"was_fingerprint"')
    (out / "config.json").write_text(config)          # no recorded fingerprint: the head rows decide
    with pytest.raises(DrafterMismatchError, match="LM head"):
        import_drafter(out, other, tmp_path / "back")
    assert import_drafter(out, target, tmp_path / "back").target_check == "head rows"
