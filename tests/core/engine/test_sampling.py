import math

import pytest
import torch

from dspark_core.engine import sampling
from dspark_core.engine.sampling import SamplingParams, greedy_verify, rejection_sample, sample, token_probs


def g(seed=0):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def test_identical_draft_is_always_accepted_and_bonus_comes_from_last_row():
    target = torch.tensor([[0.2, 0.8, 0.0], [0.1, 0.1, 0.8], [0.0, 0.0, 1.0]])
    for seed in range(50):
        n, tok = rejection_sample(torch.tensor([1, 2]), target[:2].clone(), target, g(seed))
        assert n == 2 and tok == 2  # last row is one-hot on token 2


def test_draft_token_with_zero_target_mass_is_always_rejected_and_recovered_from_residual():
    target = torch.tensor([[0.0, 0.6, 0.4], [0.3, 0.3, 0.4]])
    draft = torch.tensor([[1.0, 0.0, 0.0]])
    for seed in range(50):
        n, tok = rejection_sample(torch.tensor([0]), draft, target, g(seed))
        assert n == 0 and tok in (1, 2)


def test_residual_is_normalised_max_of_difference():
    # target (A .7, B .3), draft (.5, .5), draft picked B: accept w.p. .6; else residual (A .2, B 0) -> A.
    target = torch.tensor([[0.7, 0.3], [0.5, 0.5]])
    draft = torch.tensor([[0.5, 0.5]])
    outcomes = [rejection_sample(torch.tensor([1]), draft, target, g(s)) for s in range(4000)]
    rejected = [tok for n, tok in outcomes if n == 0]
    assert all(tok == 0 for tok in rejected)
    # acceptance ~ Binomial(4000, 0.6): sd = 31; 6 sd bound -> false failure < 1e-8
    assert abs(sum(1 for n, _ in outcomes if n == 1) - 2400) < 6 * 31


def test_one_hot_proposal_needs_no_draft_probs():
    target = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    outcomes = [rejection_sample(torch.tensor([1]), None, target, g(s)) for s in range(2000)]
    for n, tok in outcomes:
        assert (n, tok) in ((1, 0), (0, 0))   # rejected -> residual is target without token 1
    accepted = sum(n for n, _ in outcomes)
    assert abs(accepted - 1500) < 6 * math.sqrt(2000 * 0.75 * 0.25)


def test_emitted_first_token_distribution_equals_target():
    """The committed token at the first position is distributed as the target.

    Sample size 20000, V = 3; each cell is checked within 6 standard deviations, so a false failure
    has probability < 1e-8 per cell.
    """
    target = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    draft = torch.tensor([[0.1, 0.2, 0.7]])
    gen = g(1)
    counts = torch.zeros(3)
    n_samples = 20000
    for _ in range(n_samples):
        tok = int(torch.multinomial(draft[0], 1, generator=gen))
        n, nxt = rejection_sample(torch.tensor([tok]), draft, target, gen)
        counts[tok if n == 1 else nxt] += 1
    for v in range(3):
        p = float(target[0, v])
        sd = math.sqrt(n_samples * p * (1 - p))
        assert abs(counts[v] - n_samples * p) < 6 * sd


def test_k_zero_samples_the_bonus_from_the_only_row():
    n, tok = rejection_sample(torch.empty(0, dtype=torch.long), None, torch.tensor([[0.0, 1.0]]), g())
    assert (n, tok) == (0, 1)


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"\[k \+ 1, vocab\]"):
        rejection_sample(torch.tensor([1, 2]), None, torch.rand(2, 5), g())
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.tensor([1]), torch.rand(3, 5), torch.rand(2, 5), g())


def test_greedy_verify_accepts_matching_prefix_and_corrects():
    logits = torch.tensor([[0.0, 5.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    assert greedy_verify(torch.tensor([1, 0]), logits) == (2, 2)      # all accepted, bonus = argmax row 2
    assert greedy_verify(torch.tensor([1, 2]), logits) == (1, 0)      # second rejected, corrected to 0
    assert greedy_verify(torch.tensor([0, 0]), logits) == (0, 1)


def test_token_probs_greedy_topk_topp():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    assert token_probs(logits, SamplingParams(temperature=0.0)).tolist() == [1.0, 0.0, 0.0, 0.0]
    p = token_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    assert torch.allclose(p[:2], torch.softmax(logits[:2], -1))
    full = torch.softmax(logits, -1)           # [0.61, 0.22, 0.14, 0.03]
    p = token_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (p[2:] == 0).all() and p[0] > 0 and p[1] > 0   # 0.61 < 0.7, so the second token is needed
    p = token_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert full[0] > 0.5


def test_sampling_params_validate():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def _full_sort_top_p(logits, top_p):
    """The nucleus rule written plainly: sort everything, drop where the mass before reaches top_p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    p = sorted_logits.softmax(-1)
    drop = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (p.cumsum(-1) - p) >= top_p)
    return logits.masked_fill(drop, float("-inf")).softmax(-1)


@pytest.mark.parametrize("probe", [4, 256])
def test_top_p_probe_equals_the_full_sort(monkeypatch, probe):
    """Rows whose nucleus fits in the probe and rows that need the full sort, in one batch."""
    monkeypatch.setattr(sampling, "TOP_P_PROBE", probe)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 64, generator=gen) * torch.tensor([0.2, 1.0, 4.0])[:, None, None]
    for top_p in (0.3, 0.9, 0.99):
        got = token_probs(logits, SamplingParams(temperature=0.7, top_p=top_p))
        want = _full_sort_top_p(logits / 0.7, top_p)
        assert torch.equal(got > 0, want > 0)
        assert torch.allclose(got, want, atol=1e-6)
    # a real-size vocabulary: the probe's answer for peaky rows, the fallback for flat ones
    big = torch.randn(4, 49152, generator=gen) * torch.tensor([[0.1], [1.0], [3.0], [10.0]])
    got = token_probs(big, SamplingParams(temperature=1.0, top_p=0.9))
    want = _full_sort_top_p(big, 0.9)
    # nuclei of tens of thousands of tokens can differ by one boundary token (fp32 cumsum rounding)
    assert ((got > 0) != (want > 0)).sum() <= 2
    assert torch.allclose(got, want, atol=1e-4)


def test_sample_follows_the_distribution_and_never_draws_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    draws = sample(probs[None].expand(n, -1, -1), gen)                 # [n, 3]
    assert draws.shape == (n, 3)
    assert (draws[:, 1] == 5).all() and (draws[:, 0] == 0).sum() == 0 and (draws[:, 2] == 0).all()
    freq = torch.bincount(draws[:, 0], minlength=6).float() / n
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, probs[0], atol=0.015)                  # ~4.5 sigma at n = 20000
    # same generator state, same draws
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
