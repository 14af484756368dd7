"""Lossless decoding on tiny seeded targets: greedy equality and the exact output distribution at T > 0."""

import itertools

import pytest
import torch
from scipy.stats import chi2

from dspark_core.engine.decode_one import generate
from dspark_core.drafters import PROPOSER_KINDS, build_proposer
from dspark_core.engine.sampling import SamplingParams, token_probs
from tiny_models import tiny_target

DRAFTERS = [k for k in PROPOSER_KINDS if k != "none"]
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]     # repetitive, so the n-gram proposer has matches


def peaky(proposer, std=0.5, seed=0):
    """Re-initialise a model drafter with large weights: peaky draft distributions far from the target's,
    so that acceptance, rejection and residual sampling all happen often."""
    model = getattr(getattr(proposer, "inner", proposer), "drafter", None)    # dspark-lookup wraps dspark
    if model is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    torch.nn.init.normal_(p, std=std)
    return proposer


@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_speculative_equals_plain_decoding(kind):
    target = tiny_target("llama", vocab=64, seed=5)
    runner = target.runner
    params = SamplingParams(max_new_tokens=40)
    for p_i, prompt in enumerate([PROMPT, [5, 9, 33, 2], list(range(10, 40))]):
        plain = generate(runner, prompt, params).token_ids
        prop = peaky(build_proposer(kind, runner, target.fingerprint, block_size=4, preset="tiny"), seed=p_i)
        spec = generate(runner, prompt, params, prop)
        assert spec.token_ids == plain


def exact_joint(target, prompt, params, n_tokens):
    """Exact probability of every n_tokens continuation under the processed target distribution."""
    model = target.reference
    vocab = target.runner.arch.vocab_size
    probs = {}

    def dist(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        return token_probs(logits, params)

    layer = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for prefix, p in layer.items():
            d = dist(prefix)
            for v in range(vocab):
                if d[v] > 0:
                    nxt[prefix + (v,)] = p * float(d[v])
        layer = nxt
    probs.update(layer)
    return probs


def chi_square_pvalue(counts: dict, expected_probs: dict, n: int) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled into one."""
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell, p in expected_probs.items():
        e = n * p
        if e < 5:
            pool_obs += counts.get(cell, 0)
            pool_exp += e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        dof += 1
    unexpected = sum(c for cell, c in counts.items() if cell not in expected_probs)
    assert unexpected == 0, "emitted a sequence the target gives probability 0"
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        dof += 1
    return float(chi2.sf(stat, dof))


@pytest.mark.parametrize("kind,params", [
    ("ngram", SamplingParams(temperature=1.0, max_new_tokens=3)),
    ("dspark", SamplingParams(temperature=1.0, max_new_tokens=3)),
    ("dflash", SamplingParams(temperature=1.0, max_new_tokens=3)),
    ("eagle3", SamplingParams(temperature=1.0, max_new_tokens=3)),
    ("dspark-lookup", SamplingParams(temperature=1.0, max_new_tokens=3)),   # copies and model drafts mixed
    ("dspark", SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=3)),
])
def test_output_distribution_equals_target_at_temperature(kind, params):
    """The joint distribution of the first 3 generated tokens equals the target's.

    Sample size 3000 generations through the full loop (prefill, drafting with block size 2, verify,
    rejection sampling, commit) on a vocab-8 target; Pearson chi-square over the 512 joint cells
    (cells with expected count < 5 pooled). The test fails when p < 1e-4, so a correct sampler fails
    with probability 1e-4 per case; a biased sampler (e.g. accepting with p/q but not sampling the
    residual) gives p-values far below 1e-10 at this size.
    """
    target = tiny_target("llama", vocab=8, seed=11)
    runner = target.runner
    prop = peaky(build_proposer(kind, runner, target.fingerprint, block_size=2, preset="tiny"), seed=3)
    n = 3000
    gen = torch.Generator().manual_seed(1234)
    counts: dict = {}
    accepted = 0
    for _ in range(n):
        res = generate(runner, PROMPT, params, prop, generator=gen)
        cell = tuple(res.token_ids)
        counts[cell] = counts.get(cell, 0) + 1
        accepted += res.stats.accepted
    assert accepted > 0.05 * n, "the drafts were (almost) never accepted: the test would not cover acceptance"
    if hasattr(prop, "lookups"):                       # dspark-lookup: both kinds of draft were verified
        assert prop.lookups > 100 and prop.model_drafts > 100
    exact = exact_joint(target, PROMPT, params, 3)
    assert abs(sum(exact.values()) - 1) < 1e-4
    assert chi_square_pvalue(counts, exact, n) > 1e-4


def test_a_biased_sampler_is_detected():
    """Guard for the statistical test itself: plain sampling at T = 1.3 instead of 1 must fail it."""
    target = tiny_target("llama", vocab=8, seed=11)
    n = 3000
    gen = torch.Generator().manual_seed(99)
    counts: dict = {}
    wrong = SamplingParams(temperature=1.3, max_new_tokens=3)
    for _ in range(n):
        cell = tuple(generate(target.runner, PROMPT, wrong, generator=gen).token_ids)
        counts[cell] = counts.get(cell, 0) + 1
    exact = exact_joint(target, PROMPT, SamplingParams(temperature=1.0, max_new_tokens=3), 3)
    assert chi_square_pvalue(counts, exact, n) < 1e-4


def test_stop_tokens_and_max_tokens_are_honoured():
    target = tiny_target("llama", vocab=64, seed=5)
    runner = target.runner
    plain = generate(runner, PROMPT, SamplingParams(max_new_tokens=30)).token_ids
    stop = plain[7]
    first = plain.index(stop)
    for kind in ["none"] + DRAFTERS:
        prop = peaky(build_proposer(kind, runner, target.fingerprint, block_size=4, preset="tiny"))
        res = generate(runner, PROMPT, SamplingParams(max_new_tokens=30, stop_token_ids=(stop,)), prop)
        assert res.token_ids == plain[:first + 1] and res.finish_reason == "stop"
        res = generate(runner, PROMPT, SamplingParams(max_new_tokens=5), prop)
        assert res.token_ids == plain[:5] and res.finish_reason == "length"


def test_empty_and_out_of_vocab_prompts_are_rejected():
    target = tiny_target("llama", vocab=64)
    with pytest.raises(ValueError, match="empty"):
        generate(target.runner, [], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        generate(target.runner, [1, 99], SamplingParams())


def test_stats_count_rounds_and_positions():
    target = tiny_target("llama", vocab=64, seed=5)
    prop = build_proposer("ngram", target.runner, target.fingerprint, block_size=3)
    res = generate(target.runner, PROMPT * 3, SamplingParams(max_new_tokens=30), prop)
    s = res.stats
    assert s.emitted == len(res.token_ids) - 1          # the first token comes from the prefill
    assert s.accepted == sum(s.accepted_per_position) and s.verified == sum(s.verified_per_position)
    assert s.tau == pytest.approx(s.emitted / s.rounds)
    assert all(a <= v for a, v in itertools.zip_longest(s.accepted_per_position, s.verified_per_position, fillvalue=0))
