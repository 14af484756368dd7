"""Verify-length policies: SPS tables, Algorithm 1 with its early stop, the split step cost."""

import pytest
import torch

from dspark_core.engine.sampling import rejection_sample
from dspark_core.scheduling.policy import (SPSTable, causal_greedy, fixed_lengths, global_search_capacity,
                                   threshold_lengths, top_k_lengths)


def test_sps_table_is_monotone_and_extrapolates():
    t = SPSTable.monotone([10.0, 11.0, 8.0, 9.0])
    assert t.sps == (10.0, 10.0, 8.0, 8.0)
    assert t(6) < t(4)
    with pytest.raises(ValueError):
        SPSTable(())


def test_causal_greedy_follows_algorithm_1():
    sps = SPSTable((1.0, 0.9, 0.85, 0.8, 0.5))
    surv = torch.tensor([[0.9, 0.8, 0.1], [0.95, 0.2, 0.1]])
    # B=2: Theta = 2; add (1,1) .95 -> 2.95*.85; add (0,1) .9 -> 3.85*.8 = 3.08; add (0,2) .8 -> 4.65*.5 stop
    assert causal_greedy(surv, sps) == [1, 1]
    assert causal_greedy(torch.zeros(2, 3), sps) == [0, 0]


def test_counter_example_naive_global_search_is_biased_early_stop_is_exact():
    """Paper Appendix A: target (A .7, B .3), draft (.5, .5), a_1 = 0.8, c_2 = 0.9 after A and 0 after B,
    SPS(1..3) = 1, .5, .45. The naive global argmax verifies x_1 only when it is A, so P(A) = 0.85; the
    early-stop rule never verifies here and P(A) stays 0.7.

    40,000 rounds each; the standard deviation of the estimate is <= 0.0025, the bound 0.02 is 8 sd
    away (false failure < 1e-14), and 0.85 vs 0.7 is 60 sd apart.
    """
    sps = SPSTable((1.0, 0.5, 0.45))
    target = torch.tensor([[0.7, 0.3], [0.7, 0.3], [0.7, 0.3]])
    draft = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    gen = torch.Generator().manual_seed(0)

    def naive(a1, a2):
        best_len, best = 0, 1 * sps(1)
        tau = 1.0
        for j, a in enumerate((a1, a2), 1):
            tau += a
            if tau * sps(1 + j) > best:
                best, best_len = tau * sps(1 + j), j
        return best_len

    def run(policy, n=40000):
        a_count = 0
        for _ in range(n):
            x1 = int(torch.multinomial(draft[0], 1, generator=gen))
            c2 = 0.9 if x1 == 0 else 0.0
            surv = torch.tensor([[0.8, 0.8 * c2]])
            ell = policy(surv)
            if ell == 0:
                tok = int(torch.multinomial(target[0], 1, generator=gen))
            else:
                x2 = int(torch.multinomial(draft[1], 1, generator=gen))
                toks = torch.tensor([x1, x2])[:ell]
                n_acc, nxt = rejection_sample(toks, draft[:ell], target[:ell + 1], gen)
                tok = x1 if n_acc >= 1 else nxt
            a_count += tok == 0
        return a_count / n

    p_naive = run(lambda s: naive(float(s[0, 0]), float(s[0, 1])))
    p_causal = run(lambda s: causal_greedy(s, sps)[0])
    assert abs(p_naive - 0.85) < 0.02
    assert abs(p_causal - 0.7) < 0.02


def test_other_policies():
    assert fixed_lengths(3, 5, 7) == [5, 5, 5]
    assert threshold_lengths(torch.tensor([[0.9, 0.4, 0.9], [0.2, 0.9, 0.9]]), 0.5) == [1, 0]
    surv = torch.tensor([[0.9, 0.5], [0.8, 0.7]])
    assert top_k_lengths(surv, 3) == [1, 2]
    assert global_search_capacity(surv, SPSTable((1.0, 1.0, 1.0, 1.0, 1.0, 1.0))) == 4


def test_a_table_profiled_at_more_rows_keeps_its_drafting_jump_at_r_plus_1():
    from dspark_core.scheduling.policy import ScheduledPolicy
    sps16 = SPSTable(tuple([30.0] * 16 + [20.0, 19.0, 18.0]))      # 16 rows: flat, then the drafting pass
    policy = ScheduledPolicy({16: sps16}, k=2)
    assert policy.table(16) is sps16
    at15 = policy.table(15)
    assert at15(15) == 30.0 and at15(16) == 20.0 and at15(17) == 19.0   # no free one-row draft at 15 rows
    # one confident row among 15 hopeless ones: its draft does not pay for a whole drafting pass
    surv = torch.zeros(15, 2)
    surv[3] = torch.tensor([0.9, 0.8])
    assert policy.plan(list(range(15)), list(surv)) == [False] * 15
    assert ScheduledPolicy({15: sps16}, k=2).plan(list(range(15)), list(surv))[3]   # read as is: "free"


def test_forced_drafts_gather_into_few_steps():
    """Rows join one per step and never look worth drafting; each still drafts now and then for a fresh
    estimate, but the drafting passes (a fixed cost per step) are shared instead of one per join."""
    from dspark_core.scheduling.policy import ScheduledPolicy
    policy = ScheduledPolicy({8: SPSTable(tuple([30.0] * 8 + [10.0] * 40))}, k=2, explore_every=8)
    low = torch.tensor([0.05, 0.01])
    survs: dict[int, torch.Tensor | None] = {}
    last_draft: dict[int, int] = {}
    drafting_steps = 0
    for step in range(64):
        if step < 8:
            survs[step] = None                            # a new row, no history yet
        keys = sorted(survs)
        plan = policy.plan(keys, [survs[k] for k in keys])
        drafting_steps += any(plan)
        for k, go in zip(keys, plan):
            if go:
                survs[k], last_draft[k] = low, step
            assert step - last_draft.get(k, step - 4) <= 8    # nobody waits longer than explore_every
    # one pass for the first row, then every explore_every steps for all (not one per join, nor one per
    # step as the joins' due dates come round)
    assert drafting_steps <= 1 + 64 // 8


def test_step_cost_reads_a_split_profile_and_smooths_it():
    from dspark_core.scheduling.policy import StepCost
    # 2 rows: B = 1 pads B = 2; B = 3, 4 draft 1, 2 rows; B = 5.. every row drafts (their median is n = 2)
    prof = {"rows": 2, "forward_seconds": [0.010, 0.010, 0.013, 0.012, 0.014, 0.015],
            "draft_seconds": [0.0, 0.0, 0.003, 0.005, 0.004, 0.006]}
    cost = StepCost.from_profile(prof)
    assert cost.forward == pytest.approx((0.010, 0.010, 0.0125, 0.0125, 0.014, 0.015))   # pooled, not a running max
    assert cost.draft == pytest.approx((0.003, 0.005))
    assert cost.forward_s(8) == pytest.approx(0.015 + 2 * 0.005 / 4)                 # linear past the profile
    assert cost.draft_s(0) == 0.0 and cost.draft_s(4) == pytest.approx(0.010)
    assert StepCost.from_profile({"sps": [1.0]}) is None
    assert StepCost.from_profile({**prof, "draft_seconds": [0.0] * 6}) is None         # no drafter profiled
    one = cost.shifted(1)                                                              # a lone row: as if 2
    assert one.rows == 1 and one.forward_s(1) == cost.forward_s(2) and one.draft == cost.draft[:1]


def test_split_cost_lets_a_confident_row_verify_its_whole_block():
    """Profiled as one curve with drafts spread over the rows, SPS(B) prices each token past the first as
    one more row's drafting pass, and the scheduled policy cut a confident row's block short; with the
    drafting pass apart, each further token costs its forward time only."""
    from dspark_core.scheduling.policy import ScheduledPolicy, StepCost
    R, k = 4, 4
    fwd = lambda B: 0.030 + 0.0004 * max(0, B - R)                                    # noqa: E731
    drafting = lambda n: 0.003 + 0.004 * n                                            # noqa: E731
    # the single curve: at B = R + n (n <= R) n rows draft; past 2R all R do
    sps = SPSTable.monotone([1 / (fwd(B) + (drafting(min(B - R, R)) if B > R else 0.0)) for B in range(1, R * (k + 1) + 1)])
    cost = StepCost(R, tuple(fwd(B) for B in range(1, R * (k + 1) + 1)), tuple(drafting(n) for n in range(1, R + 1)))
    surv = [torch.tensor([0.5, 0.3, 0.2, 0.1]), None, None, None]
    limits = [k, 0, 0, 0]
    old = ScheduledPolicy({R: sps}, k=k)(surv, limits)
    new = ScheduledPolicy({R: sps}, k=k, costs={R: cost})(surv, limits)
    assert new == [4, 0, 0, 0] and old == [1, 0, 0, 0]
    # who drafts: the confident row's expected gain pays for its pass; a hopeless row's does not
    policy = ScheduledPolicy({R: sps}, k=k, costs={R: cost}, explore_every=100)
    prev = [torch.tensor([0.9, 0.8, 0.7, 0.6]), torch.tensor([0.05, 0.01, 0.0, 0.0]),
            torch.tensor([0.1, 0.02, 0.0, 0.0]), torch.tensor([0.02, 0.0, 0.0, 0.0])]
    assert policy.plan([0, 1, 2, 3], prev) == [True, False, False, False]
    # with a drafting pass dearer than anything the rows could gain, the step runs plain
    dear = StepCost(R, cost.forward, tuple(0.05 for _ in range(R)))
    policy = ScheduledPolicy({R: sps}, k=k, costs={R: dear}, explore_every=100)
    assert policy.plan([0, 1, 2, 3], prev) == [False] * 4


def test_the_policy_learns_the_engines_overhead_per_drafting_row_and_drafts_less_for_it():
    """A speculative step's engine work per drafting row (accept, advance the drafter, bookkeeping) is not in
    the offline profile: the policy measures it from the steps the engine reports (beyond a plain step's
    excess) and prices it into who drafts; a plain arm's steps (a live gate's) count for the plain excess."""
    from dspark_core.scheduling import LiveGate
    from dspark_core.scheduling.policy import ScheduledPolicy, StepCost
    R, k = 4, 4
    fwd = lambda B: 0.030 + 0.0004 * max(0, B - R)                                    # noqa: E731
    cost = StepCost(R, tuple(fwd(B) for B in range(1, R * (k + 1) + 1)), tuple(0.002 for _ in range(R)))
    sps = SPSTable(tuple(1 / fwd(B) for B in range(1, R * (k + 1) + 1)))
    prev = [torch.tensor([0.3, 0.1, 0.0, 0.0])] * R
    policy = ScheduledPolicy({R: sps}, k=k, costs={R: cost}, explore_every=1000)
    keys = [0, 1, 2, 3]
    assert policy.plan(keys, prev) == [True] * R and policy.row_overhead == 0.0     # cheap drafts pay
    for step in range(200):                      # the engine: plain steps 1 ms over the profile, spec 5 ms per row
        draft = policy.plan(keys, prev)
        n = sum(draft)
        if n:
            lengths = policy([p if d else None for p, d in zip(prev, draft)], [k if d else 0 for d in draft])
            seconds = cost.draft_s(n) + cost.forward_s(R + sum(lengths)) + 0.001 + 0.005 * n
        else:
            seconds = cost.forward_s(R) + 0.001
        policy.observe(R, R, seconds)
        if step % 2:                             # a gate's plain step between: the policy hears of it too
            policy.note_plain(R)
            policy.observe(R, R, cost.forward_s(R) + 0.001)
    # it learns until the drafts stop paying (then steps run plain and there is nothing more to learn from)
    assert 0.001 < policy.row_overhead <= 0.005 and abs(policy.describe()["plain_excess_ms"] - 1.0) < 0.1
    assert policy.plan(keys, prev) == [False] * R
    gate = LiveGate(ScheduledPolicy({R: sps}, k=k, costs={R: cost}), explore_every=1000)
    gate.inner.row_overhead = 0.0
    gate.last_arm = "plain"
    gate._last_bucket = 4
    gate.inner.note_plain(R)
    gate.observe(R, R, cost.forward_s(R) + 0.002)            # the gate hands each step to its inner policy
    assert gate.inner.describe()["plain_excess_ms"] > 0
