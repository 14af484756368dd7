"""``dspark export`` / ``dspark import`` on the real SmolLM2 target: speculators loads the export against
the prepared target folder, and the import drafts what the original drafter drafts."""

import json

import pytest
import torch

from dspark_core.cli.main import main
from dspark_core.drafters import BlockProposer, build_drafter, drafter_config
from dspark_core.drafters.checkpoint import load_drafter, save_drafter
from dspark_core.engine.sampling import SamplingParams

from speculators import SpeculatorModel   # installed by make install (--no-deps, see the Makefile)


@pytest.mark.real
def test_export_import_cli_on_smollm2(smollm2, dspark_home, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DSPARK_HOME", str(dspark_home))
    r = smollm2.runner
    model = build_drafter(drafter_config("dspark", r.arch, "default", block_size=5, draft_vocab_size=2048), r, seed=3)
    model.head.set_vocab(torch.randperm(r.arch.vocab_size, generator=torch.Generator().manual_seed(1))[:2048])
    ckpt = save_drafter(model, tmp_path / "ckpt", smollm2.fingerprint)

    assert main(["export", str(ckpt), "--format", "speculators", "--out", str(tmp_path / "spec"), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["target layers"] == [t + 1 for t in model.cfg.target_layer_ids]
    _, info = SpeculatorModel.from_pretrained(str(tmp_path / "spec"), output_loading_info=True)
    assert not info["unexpected_keys"]
    assert set(info["missing_keys"]) <= {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    theirs = SpeculatorModel.from_pretrained(str(tmp_path / "spec"))
    torch.testing.assert_close(theirs.embed_tokens.weight, r.embed.float())     # the verifier found by path

    assert main(["import", str(tmp_path / "spec"), "--out", str(tmp_path / "back"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target_check"] == "fingerprint" and report["kind"] == "dspark"
    back = load_drafter(tmp_path / "back", r, smollm2.fingerprint)
    ids = smollm2.tokenizer("def fibonacci(n):\n    if n < 2:\n        return n")["input_ids"]
    out = r.forward(r.new_cache(1, len(ids) + 8), torch.tensor([ids]), taps=model.cfg.target_layer_ids, logits="none")
    greedy = SamplingParams(max_new_tokens=5)
    drafts = []
    for m in (model, back):
        prop = BlockProposer(m)
        state = prop.start(ids[:-1], out.taps[0, :-1])
        drafts.append(prop.propose(state, ids[-1], 5, greedy, None))
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    torch.testing.assert_close(drafts[0].confidence_logits, drafts[1].confidence_logits)

    legacy = build_drafter(drafter_config("dspark", r.arch, "tiny", context_norm=True), r)
    save_drafter(legacy, tmp_path / "legacy", smollm2.fingerprint)
    assert main(["export", str(tmp_path / "legacy"), "--format", "deepspec", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "error: this dspark drafter is not in the reference layout" in err and "context_norm is on" in err
    assert not (tmp_path / "x").exists()
