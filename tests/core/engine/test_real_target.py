"""Capability checks on the real SmolLM2-135M-Instruct target (fp32)."""

import json

import pytest
import torch

from dspark_core.engine.decode_one import generate
from dspark_core.engine.inputs import encode_prompt
from dspark_core.drafters import PROPOSER_KINDS, build_proposer
from dspark_core.engine.sampling import SamplingParams
from tiny_models import OracleProposer

pytestmark = pytest.mark.real

PROMPTS = [
    ("chat", "Explain why the sky is blue to a ten-year-old."),
    ("chat", "Write a Python function that returns the n-th prime number."),
    ("raw", "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"),
    ("chat", "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many are left?"),
]
N_NEW = 64


@pytest.fixture(scope="module")
def references(smollm2):
    """HF ``generate`` greedy continuations (the slow reference), no early stop."""
    refs = []
    for mode, text in PROMPTS:
        ids = encode_prompt(smollm2.tokenizer, text, chat=mode == "chat")
        with torch.inference_mode():
            out = smollm2.reference.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                             eos_token_id=None, pad_token_id=0)
        refs.append((ids, out[0, len(ids):].tolist()))
    return refs


@pytest.mark.parametrize("kind", PROPOSER_KINDS)
def test_greedy_output_equals_hf_generate_for_every_proposer(smollm2, references, kind):
    params = SamplingParams(max_new_tokens=N_NEW)
    prop = build_proposer(kind, smollm2.runner, smollm2.fingerprint, block_size=7)
    for ids, ref in references:
        res = generate(smollm2.runner, ids, params, prop)
        assert len(ref) == N_NEW
        assert res.token_ids == ref


def test_greedy_equality_with_long_accepted_runs(smollm2, references):
    """An oracle drafter (the reference continuation, corrupted now and then) forces multi-token accepts."""
    params = SamplingParams(max_new_tokens=N_NEW)
    for ids, ref in references[:2]:
        prop = OracleProposer(ref, smollm2.runner.arch.vocab_size, block=6)
        res = generate(smollm2.runner, ids, params, prop)
        assert res.token_ids == ref
        assert res.stats.tau > 2.0 and res.stats.accepted < res.stats.verified


def test_runner_matches_hf_logits_after_rollback(smollm2):
    r, model = smollm2.runner, smollm2.reference
    ids = smollm2.tokenizer("Speculative decoding verifies a block of draft tokens in one pass.").input_ids
    cache = r.new_cache(1, 64)
    r.forward(cache, torch.tensor([ids[:8]]))
    r.forward(cache, torch.tensor([[11, 12, 13, 14]]))       # a rejected draft block
    cache.truncate(0, 8)
    out = r.forward(cache, torch.tensor([ids[8:]]), logits="all")
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, 8:]
    torch.testing.assert_close(out.logits[0], ref, rtol=1e-4, atol=2e-4)


def test_cached_target_loads_without_the_gguf_and_carries_a_fingerprint(smollm2, monkeypatch):
    """Loading from the cache never dequantises the GGUF again (that is the slow part, ~20 s)."""
    import transformers

    from dspark_core.model import target as target_mod
    manifest = json.loads((smollm2.path / "dspark_target.json").read_text())
    assert manifest["fingerprint"] == smollm2.fingerprint and len(smollm2.fingerprint) == 64

    def no_gguf(*a, **kw):
        raise AssertionError("the cached load touched the GGUF")
    monkeypatch.setattr(target_mod, "find_smollm2_gguf", no_gguf)
    real = transformers.AutoModelForCausalLM.from_pretrained

    def guarded(*a, **kw):
        assert "gguf_file" not in kw
        return real(*a, **kw)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", guarded)
    again = target_mod.load_target(smollm2.path)
    assert again.fingerprint == smollm2.fingerprint
    assert smollm2.stop_token_ids == (2,)


def test_sampled_generation_is_reproducible_with_a_seed(smollm2):
    ids = encode_prompt(smollm2.tokenizer, "Name three colours.", chat=True)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=24)
    prop = build_proposer("ngram", smollm2.runner, smollm2.fingerprint)
    a = generate(smollm2.runner, ids, params, prop, generator=torch.Generator().manual_seed(5)).token_ids
    b = generate(smollm2.runner, ids, params, prop, generator=torch.Generator().manual_seed(5)).token_ids
    assert a == b
