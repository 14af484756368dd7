"""The formats' conventions (target-layer ids, DeepSpec's folder) and the refusals of what cannot map."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from dspark_core.drafters import build_drafter, drafter_config
from dspark_core.drafters.block import block_train_forward
from dspark_core.drafters.checkpoint import load_drafter, save_drafter
from dspark_core.formats import FormatError, export_drafter, from_format_ids, import_drafter, to_format_ids
from tiny_models import tiny_target


def _target(tmp_path, family="llama"):
    target = tiny_target(family, vocab=64, seed=7, layers=5)
    folder = tmp_path / "verifier"
    target.reference.save_pretrained(folder)
    return replace(target, path=folder)


def _drafter(target, seed=1, **kw):
    model = build_drafter(drafter_config("dspark", target.arch, "tiny", block_size=4, **kw), target.runner, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_layer_id_conventions_name_the_same_hidden_state(family):
    """Our tap j is transformers' hidden_states[j + 1] (hidden_states[0] the embeddings): the speculators and
    vLLM id; DeepSpec's id is ours (vLLM adds the 1 when it loads a DeepSpec checkpoint)."""
    target = tiny_target(family, vocab=64, seed=7, layers=5)
    taps = (-1, 0, 2, 3)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    r = target.runner
    ours = r.forward(r.new_cache(1, 16), tokens, taps=taps, logits="none").taps[0].view(12, len(taps), -1)
    hf = target.reference(tokens, output_hidden_states=True).hidden_states
    for i, spec_id in enumerate(to_format_ids("speculators", taps)):
        torch.testing.assert_close(ours[:, i], hf[spec_id][0], rtol=1e-4, atol=1e-4)
    assert to_format_ids("speculators", taps) == [0, 1, 3, 4]
    assert to_format_ids("deepspec", taps) == list(taps)
    for fmt in ("speculators", "deepspec"):
        assert from_format_ids(fmt, to_format_ids(fmt, taps)) == taps


def test_deepspec_folder_round_trips_exactly(tmp_path):
    target = _target(tmp_path)
    model = _drafter(target, draft_vocab_size=20)
    model.head.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(3))[:20])
    ckpt = save_drafter(model, tmp_path / "ckpt", target.fingerprint)
    out = export_drafter(ckpt, target, "deepspec", tmp_path / "deepspec")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["target_layer_ids"] == list(model.cfg.target_layer_ids)
    assert config["num_target_layers"] == 5 and config["mask_token_id"] == 63 and config["draft_vocab_size"] == 20
    weights = load_file(str(out / "model.safetensors"))
    assert {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "markov_head.markov_w1.weight",
            "confidence_head.proj.bias", "layers.0.self_attn.q_norm.weight"} <= set(weights)
    d2t = weights["d2t"]
    assert (torch.arange(20) + d2t).tolist() == sorted(model.head.vocab_ids.tolist())   # offsets, ascending

    report = import_drafter(out, target, tmp_path / "back")
    assert (report.format, report.target_check) == ("deepspec", "fingerprint")
    back = load_drafter(tmp_path / "back", target.runner, target.fingerprint)
    taps = torch.randn(1, 20, len(model.cfg.target_layer_ids) * 32)
    tokens = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(4))
    anchors, keep = torch.arange(16)[None], torch.ones(1, 16, dtype=torch.bool)
    a, ca = block_train_forward(model.eval(), taps, tokens, anchors, keep)
    b, cb = block_train_forward(back.eval(), taps, tokens, anchors, keep)
    order = torch.argsort(model.head.vocab_ids)   # the imported vocabulary is in ascending target-id order
    torch.testing.assert_close(b, a[..., order])
    torch.testing.assert_close(cb, ca)


def test_a_drafter_outside_the_reference_layout_is_refused_with_its_fields(tmp_path):
    target = _target(tmp_path)
    legacy = _drafter(target, qk_norm=False, context_norm=True, mask_token_id=-1)
    ckpt = save_drafter(legacy, tmp_path / "legacy", target.fingerprint)
    with pytest.raises(FormatError, match="qk_norm is off.*context_norm is on.*learned vector"):
        export_drafter(ckpt, target, "speculators", tmp_path / "x")
    eagle = build_drafter(drafter_config("eagle3", target.arch, "tiny"), target.runner)
    with pytest.raises(FormatError, match="eagle3"):
        export_drafter(save_drafter(eagle, tmp_path / "eagle", target.fingerprint), target, "speculators", tmp_path / "y")
    dflash = build_drafter(drafter_config("dflash", target.arch, "tiny"), target.runner)
    with pytest.raises(FormatError, match="--format speculators"):
        export_drafter(save_drafter(dflash, tmp_path / "dflash", target.fingerprint), target, "deepspec", tmp_path / "z")
    with pytest.raises(FormatError, match="unknown format"):
        export_drafter(ckpt, target, "onnx", tmp_path / "w")


def test_import_refuses_what_dspark_does_not_implement(tmp_path):
    target = _target(tmp_path)
    ckpt = save_drafter(_drafter(target), tmp_path / "ckpt", target.fingerprint)
    out = export_drafter(ckpt, target, "speculators", tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    for change, message in [({"markov_head_type": "gated"}, "markov_head_type 'gated'"),
                            ({"sample_from_anchor": False}, "sample_from_anchor is false"),
                            ({"aux_hidden_state_layer_ids": [1, 5]}, "do not fit target"),
                            ({"speculators_model_type": "eagle3"}, "not a block drafter")]:
        (out / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            import_drafter(out, target, tmp_path / "back")


def test_export_writes_the_checkpoint_weights_as_stored_whatever_the_target_dtype(tmp_path):
    """A target loaded in bf16 (the flows' and serving's dtype) must not round the drafter on its way out."""
    from tiny_models import runner_for
    target = _target(tmp_path)
    model = _drafter(target)
    ckpt = save_drafter(model, tmp_path / "ckpt", target.fingerprint)
    bf16 = replace(target, runner=runner_for(target.reference, torch.bfloat16))
    out = export_drafter(ckpt, bf16, "speculators", tmp_path / "spec")
    saved, written = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert torch.equal(written["fc.weight"], saved["fc.weight"])
    assert torch.equal(written["markov_head.markov_w1.weight"], saved["markov_in.weight"])
