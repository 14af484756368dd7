"""Batched speculative decoding: ragged verify lengths in one forward stay lossless."""

import pytest
import torch

from dspark_core.engine.offset import RequestOffset
from dspark_core.engine.decode_one import generate
from dspark_core.drafters import build_proposer
from dspark_core.engine.policy import LengthRule
from dspark_core.engine.sampling import SamplingParams
from dspark_core.scheduling.policy import SPSTable, make_policy
from dspark_core.engine.spec_batch import SpecRequest, run_requests
from tiny_models import peaky, tiny_target

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 33, 2], list(range(10, 30)), [7, 7, 8, 7, 7, 8, 7], [40, 41]]


def _random_policy(seed):
    gen = torch.Generator().manual_seed(seed)

    def lengths(survs, limits):       # lengths drawn independently of the drafted tokens
        return [int(torch.randint(0, m + 1, (1,), generator=gen)) if m else 0 for m in limits]
    return LengthRule("random", lengths)


@pytest.mark.parametrize("policy_name", ["random", "fixed", "threshold", "threshold-offset", "scheduled",
                                         "scheduled-split"])
def test_batched_greedy_equals_plain_decoding_with_mixed_proposers_and_lengths(policy_name):
    from dspark_core.scheduling.policy import ScheduledPolicy, StepCost
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    params = SamplingParams(max_new_tokens=24)
    plain = [generate(r, p, params).token_ids for p in PROMPTS]
    kinds = ["dspark", "ngram", "dflash", "eagle3", "none"]
    reqs = [SpecRequest(i, p, params, peaky(build_proposer(k, r, target.fingerprint, preset="tiny", block_size=4),
                                             i)) for i, (p, k) in enumerate(zip(PROMPTS, kinds))]
    if policy_name.endswith("-offset"):          # each request's own confidence offset moves its lengths
        for req in reqs:
            req.adapt = RequestOffset(1.0)
    policy = {"random": _random_policy(0),
              "fixed": make_policy("fixed", k=3),
              "threshold": make_policy("threshold", k=3, threshold=0.4),
              "threshold-offset": make_policy("threshold", k=3, threshold=0.4),
              "scheduled": make_policy("scheduled", SPSTable((10.0, 9.8, 9.5, 9.0, 8.0, 7.0, 6.0, 5.0)), k=2),
              # the split step cost through plan (who drafts) and the per-step call, joins and leaves included
              "scheduled-split": ScheduledPolicy({3: SPSTable((10.0,) * 3 + (9.0,) * 6)}, k=2, explore_every=3,
                                                 costs={3: StepCost(3, (0.1,) * 3 + tuple(0.1 + 0.004 * i
                                                                                          for i in range(1, 7)),
                                                                    (0.01, 0.012, 0.014))})}[policy_name]
    done = run_requests(r, reqs, policy, max_batch=3)        # 5 requests through 3 slots: joins and leaves
    assert sorted(x.key for x in done) == list(range(5))
    for req in done:
        assert req.tokens == plain[req.key], (req.key, policy_name)
        assert req.finish_reason == "length"


def test_output_does_not_depend_on_batch_companions():
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    params = SamplingParams(temperature=1.0, max_new_tokens=16)

    def run(prompts):
        reqs = [SpecRequest(i, p, params, build_proposer("ngram", r, target.fingerprint, block_size=3),
                            torch.Generator().manual_seed(100 + i)) for i, p in enumerate(prompts)]
        return {x.key: x.tokens for x in run_requests(r, reqs, make_policy("fixed", k=3), max_batch=4)}
    alone = run(PROMPTS[:1])[0]
    together = run(PROMPTS)[0]
    assert alone == together


def test_shadow_rounds_verify_the_whole_block_and_are_marked():
    from dspark_core.engine.spec_batch import SpecBatch
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    params = SamplingParams(max_new_tokens=20)
    batch = SpecBatch(r, shadow_fraction=0.5, seed=3)
    prop = peaky(build_proposer("dspark", r, target.fingerprint, preset="tiny", block_size=4), 1)
    req = SpecRequest(0, PROMPTS[0], params, prop, record_rounds=True)
    batch.add(req)
    policy = make_policy("fixed", k=1)
    while req.finish_reason is None:
        batch.step(policy)
    log = req.stats.round_log
    full = [x for x in log if x["full_verify"]]
    assert full and len(full) < len(log)
    assert all(x["verified"] == x["drafted"] for x in full)
    assert all(x["verified"] <= 1 for x in log if not x["full_verify"])
    assert all(len(x["confidence_logits"]) == x["drafted"] for x in log if x["drafted"])
    assert req.tokens == generate(r, PROMPTS[0], params).token_ids


def test_scheduled_policy_with_draft_skipping_stays_lossless_and_skips_under_load():
    from dspark_core.scheduling.policy import ScheduledPolicy
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    params = SamplingParams(max_new_tokens=24)
    plain = [generate(r, p, params).token_ids for p in PROMPTS]
    # a table where extra tokens are expensive: speculation rarely pays, so most rounds skip drafting
    steep = {1: SPSTable((10.0, 5.0, 4.0, 3.0, 2.5)), 4: SPSTable(tuple([10.0] * 4 + [5.0] * 16))}
    policy = ScheduledPolicy(steep, k=4, explore_every=4)
    reqs = [SpecRequest(i, p, params, peaky(build_proposer("dspark", r, target.fingerprint, preset="tiny",
                                                            block_size=4), i), record_rounds=True)
            for i, p in enumerate(PROMPTS)]
    done = run_requests(r, reqs, policy, max_batch=4)
    for req in done:
        assert req.tokens == plain[req.key]
    rounds = [x for req in done for x in req.stats.round_log]
    skipped = sum(1 for x in rounds if x["drafted"] == 0)
    assert skipped > len(PROMPTS)              # more than the last round of each request: skipping happened
    assert skipped < len(rounds)               # and exploration still drafts now and then


@pytest.mark.parametrize("policy_name", ["scheduled", "scheduled-split", "threshold", "threshold-offset", "fixed"])
def test_batched_sampling_keeps_the_target_distribution_under_each_policy(policy_name):
    """Joint distribution of the first 3 tokens at T = 1 through SpecBatch (batches of 16, confidence-driven
    lengths, draft skipping for the scheduled policy) against the exact target distribution.

    3000 requests, each with its own generator; Pearson chi-square over the 512 joint cells (expected < 5
    pooled); fails when p < 1e-4, i.e. a false failure has probability 1e-4 per case.
    """
    from dspark_core.scheduling.policy import ScheduledPolicy, StepCost
    from test_lossless import PROMPT, chi_square_pvalue, exact_joint
    target = tiny_target("llama", vocab=8, seed=11)
    r = target.runner
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    prop = peaky(build_proposer("dspark", r, target.fingerprint, preset="tiny", block_size=2), 3)
    tables = {16: SPSTable(tuple([10.0] * 16 + [9.8 - 0.1 * i for i in range(32)]))}
    # split cost: drafting 2 ms, each verified token 0.1 ms over a 20 ms forward (drafts pay: long verifies)
    costs = {16: StepCost(16, tuple([0.02] * 16 + [0.02 + 0.0001 * i for i in range(1, 33)]), tuple([0.002] * 16))}
    policy = {"scheduled": ScheduledPolicy(tables, k=2, explore_every=3),
              "scheduled-split": ScheduledPolicy(tables, k=2, explore_every=3, costs=costs),
              "threshold": make_policy("threshold", k=2, threshold=0.3),
              "threshold-offset": make_policy("threshold", k=2, threshold=0.3),
              "fixed": make_policy("fixed", k=2)}[policy_name]
    n = 3000
    reqs = [SpecRequest(i, PROMPT, params, prop, torch.Generator().manual_seed(7000 + i),
                        adapt=RequestOffset(0.5) if policy_name.endswith("-offset") else None) for i in range(n)]
    done = run_requests(r, reqs, policy, max_batch=16)
    counts: dict = {}
    for req in done:
        counts[tuple(req.tokens)] = counts.get(tuple(req.tokens), 0) + 1
    assert sum(req.stats.accepted for req in done) > 0.05 * n
    exact = exact_joint(target, PROMPT, params, 3)
    assert chi_square_pvalue(counts, exact, n) > 1e-4


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_batched_drafting_matches_per_request_drafting(kind):
    """propose_batch over contexts of different lengths gives each row what propose gives it alone:
    same greedy tokens, same confidences; at T = 1 each row consumes only its own generator."""
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    prop = peaky(build_proposer(kind, r, target.fingerprint, preset="tiny", block_size=4), 1)
    prompts, anchors, ks = PROMPTS[:4], [3, 8, 21, 40], [4, 2, 0, 3]
    states_a, states_b = [], []
    for p in prompts:
        out = r.forward(r.new_cache(1, 64), torch.tensor([p]), taps=prop.tap_layers)
        states_a.append(prop.start(p, out.taps[0]))
        states_b.append(prop.start(p, out.taps[0]))
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        gens_a = [torch.Generator().manual_seed(i) for i in range(4)]
        gens_b = [torch.Generator().manual_seed(i) for i in range(4)]
        single = [prop.propose(s, a, k, params, g) for s, a, k, g in zip(states_a, anchors, ks, gens_a)]
        batched = prop.propose_batch(states_b, anchors, ks, [params] * 4, gens_b)
        for one, many, k in zip(single, batched, ks):
            assert len(one) == len(many) == k
            assert one.tokens.tolist() == many.tokens.tolist()
            if one.confidence_logits is not None and k:
                torch.testing.assert_close(one.confidence_logits, many.confidence_logits, atol=1e-4, rtol=1e-4)
            if one.draft_probs is not None:
                torch.testing.assert_close(one.draft_probs, many.draft_probs, atol=1e-5, rtol=1e-4)
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens_a, gens_b))


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_shared_drafter_batched_greedy_equals_plain_decoding(kind):
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    params = SamplingParams(max_new_tokens=20)
    plain = [generate(r, p, params).token_ids for p in PROMPTS]
    prop = peaky(build_proposer(kind, r, target.fingerprint, preset="tiny", block_size=4), 2)
    reqs = [SpecRequest(i, p, params, prop) for i, p in enumerate(PROMPTS)]
    done = run_requests(r, reqs, _random_policy(3), max_batch=4)
    for req in done:
        assert req.tokens == plain[req.key]
    assert sum(req.stats.drafted for req in done) > 0


def test_lookup_copies_scheduled_by_their_observed_acceptance_stay_lossless():
    """dspark-lookup behind the scheduled policy at batch 4: copies carry confidences learned from
    earlier copies (the scheduler may cut them short), greedy output equals plain decoding."""
    from dspark_core.scheduling.policy import ScheduledPolicy
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    params = SamplingParams(max_new_tokens=40)
    prompts = [p + p for p in PROMPTS]                       # repeats: lookup finds copies
    plain = [generate(r, p, params).token_ids for p in prompts]
    prop = build_proposer("dspark-lookup", r, target.fingerprint, preset="tiny", block_size=4)
    tables = {4: SPSTable(tuple([10.0] * 4 + [9.0 - 0.3 * i for i in range(24)]))}
    reqs = [SpecRequest(i, p, params, prop) for i, p in enumerate(prompts)]
    done = run_requests(r, reqs, ScheduledPolicy(tables, k=4, explore_every=3), max_batch=4)
    for req in done:
        assert req.tokens == plain[req.key]
    assert prop.lookups > 0 and prop.copy_reached[0] > 0
    assert all(a <= n for a, n in zip(prop.copy_accepted, prop.copy_reached))


def test_batched_sampling_keeps_the_target_distribution_with_scheduled_lookup_copies():
    """dspark-lookup behind the scheduled policy at T = 1 (batches of 16): copies carry confidences
    learned from earlier copies, so the scheduler cuts them at lengths of its choosing; the joint
    distribution of the first 3 tokens stays the target's (same chi-square test as above)."""
    from dspark_core.scheduling.policy import ScheduledPolicy
    from test_lossless import PROMPT, chi_square_pvalue, exact_joint
    from test_lossless import peaky as peaky_inner
    target = tiny_target("llama", vocab=8, seed=11)
    r = target.runner
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    prop = peaky_inner(build_proposer("dspark-lookup", r, target.fingerprint, preset="tiny", block_size=2), seed=3)
    # requests this short end before a copy's outcome is learned, so start from learned counts: a copy's
    # first position accepted 60 % of the time, its second 20 %: the scheduler cuts some copies
    prop.copy_reached, prop.copy_accepted = [100, 60], [60, 12]
    # verify cost rising steeply past 16 tokens: cutting a copy short is the scheduler's best choice often
    tables = {16: SPSTable(tuple([10.0] * 16 + [9.8 - 0.3 * i for i in range(32)]))}
    n = 3000
    reqs = [SpecRequest(i, PROMPT, params, prop, torch.Generator().manual_seed(9000 + i), record_rounds=True)
            for i in range(n)]
    done = run_requests(r, reqs, ScheduledPolicy(tables, k=2, explore_every=3), max_batch=16)
    counts: dict = {}
    for req in done:
        counts[tuple(req.tokens)] = counts.get(tuple(req.tokens), 0) + 1
    assert prop.lookups > 100 and prop.model_drafts > 100
    cut = [x for req in done for x in req.stats.round_log if x["verified"] < x["drafted"]]
    assert len(cut) > 50                                     # drafts were cut short, and it stays exact
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT, params, 3), n) > 1e-4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_batched_generation_equals_one_request_at_a_time(temperature):
    """``generate_batch`` (the bootstrap's trace generator): longest prompts first, rows refilled, the tail
    compacted; every request's tokens equal its own ``generate`` with the same seeded generator, and each
    comes back once with the right finish reason."""
    from dspark_core.engine.plain_batch import BatchRequest, generate_batch
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    prompts = PROMPTS + [list(range(3, 3 + n)) for n in (1, 12, 6, 25, 3, 9)]
    stop = (17,)
    params = [SamplingParams(temperature=temperature, top_p=0.9 if temperature else 1.0,
                             max_new_tokens=6 + 3 * (i % 4), stop_token_ids=stop) for i in range(len(prompts))]
    gen = lambda i: torch.Generator().manual_seed(100 + i)  # noqa: E731
    alone = [generate(r, p, sp, generator=gen(i)) for i, (p, sp) in enumerate(zip(prompts, params))]
    seen = []
    done = generate_batch(r, [BatchRequest(i, p, sp, gen(i)) for i, (p, sp) in enumerate(zip(prompts, params))], 4,
                          on_result=lambda res: seen.append(res.key))
    assert sorted(x.key for x in done) == list(range(len(prompts))) and seen == [x.key for x in done]
    for res in done:
        ref = alone[res.key]
        assert res.token_ids == ref.token_ids and res.prompt_ids == prompts[res.key]
        assert res.finish_reason == ref.finish_reason


def test_plain_batched_generation_prefills_waiting_prompts_together():
    """Prompts that start together share one packed prefill forward, up to ``prefill_tokens`` padded tokens
    each; a prompt done at its first token hands its row to the next one; the tokens are those of one
    prefill per prompt."""
    from dspark_core.engine.plain_batch import BatchRequest, generate_batch
    target = tiny_target("llama", vocab=64, seed=5)
    r = target.runner
    prompts = PROMPTS + [list(range(3, 3 + n)) for n in (1, 12, 6, 25, 3, 9)]
    params = [SamplingParams(max_new_tokens=1 if i in (2, 7) else 5 + i % 3) for i in range(len(prompts))]
    prefills = []
    forward = r.forward

    def counted(cache, ids, **kw):
        if ids.shape[1] > 1 or kw.get("lengths"):
            prefills.append(ids.shape[0])
        return forward(cache, ids, **kw)

    runs = {}
    for budget in (1, 4096):
        prefills.clear()
        r.forward = counted
        try:
            done = generate_batch(r, [BatchRequest(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))], 4,
                                  prefill_tokens=budget)
        finally:
            r.forward = forward
        runs[budget] = ({x.key: x.token_ids for x in done}, list(prefills))
    assert runs[1][0] == runs[4096][0] and sorted(runs[1][0]) == list(range(len(prompts)))
    assert runs[1][0][2] == [generate(r, prompts[2], params[2]).token_ids[0]]
    assert runs[1][1] == [1] * len(prompts)                     # one prompt per forward
    assert runs[4096][1][0] == 4 and sum(runs[4096][1]) == len(prompts) and len(runs[4096][1]) < len(prompts)
    with pytest.raises(ValueError, match="prefill_tokens"):
        generate_batch(r, [BatchRequest(0, [1, 2], params[0])], 2, prefill_tokens=0)


def test_bf16_batched_greedy_rows_equal_plain_decoding_beside_a_sampled_row():
    """In bf16 the batched step takes greedy rows' argmax from bf16 logits (no fp32 copy when no row
    samples); ties in coarse bf16 logits must resolve as plain decoding's fp32 argmax does."""
    from dataclasses import replace

    from tiny_models import runner_for, tiny_hf_model
    model = tiny_hf_model("llama", vocab=64, seed=5)
    target = replace(tiny_target("llama", vocab=64, seed=5), runner=runner_for(model, torch.bfloat16))
    r = target.runner
    greedy = SamplingParams(max_new_tokens=24)
    plain = [generate(r, p, greedy).token_ids for p in PROMPTS]
    for with_sampled in (False, True):
        reqs = [SpecRequest(i, p, greedy, peaky(build_proposer(k, r, target.fingerprint, preset="tiny", block_size=4),
                                                 i)) for i, (p, k) in enumerate(zip(PROMPTS[:3], ["dspark", "ngram",
                                                                                                   "dflash"]))]
        if with_sampled:
            reqs.append(SpecRequest(9, PROMPTS[3], SamplingParams(temperature=1.0, max_new_tokens=24),
                                    build_proposer("ngram", r, target.fingerprint, block_size=3),
                                    torch.Generator().manual_seed(9)))
        done = run_requests(r, reqs, make_policy("fixed", k=3), max_batch=4)
        for req in done:
            if req.key != 9:
                assert req.tokens == plain[req.key], (req.key, with_sampled)
