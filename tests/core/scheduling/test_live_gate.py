"""The live speculation gate: it runs the faster arm per load, brackets its comparisons, stays exact."""

from dspark_core.engine.decode_one import generate
from dspark_core.engine.sampling import SamplingParams
from dspark_core.scheduling import LiveGate, ScheduledPolicy, SPSTable
from dspark_core.engine.spec_batch import SpecRequest, run_requests
from tiny_models import SelfDraftProposer


def _feed(gate, rows, rates, steps):
    arms = []
    for _ in range(steps):
        plan = gate.plan(list(range(rows)), [None] * rows)
        arm = gate.last_arm
        arms.append(arm)
        assert (arm == "plain") == (not any(plan))
        gate.observe(rows, int(rates[arm]), 1.0)
    return arms



def test_live_gate_runs_the_faster_arm_per_load_and_keeps_exploring():
    inner = ScheduledPolicy({1: SPSTable((10.0, 9.0, 8.0))}, k=2)
    # no hurdle, no bracket price (explore_budget=0): the bare comparison and its backoff
    gate = LiveGate(inner, explore_every=16, window=4, hurdle=0.0, explore_budget=0.0)
    heavy = _feed(gate, 16, {"spec": 90, "plain": 150}, 400)        # at 16 rows plain decoding is faster
    light = _feed(gate, 1, {"spec": 45, "plain": 40}, 400)          # alone, speculation wins (by 12.5 %)
    # the first bracket at once: speculation (a switch step + 4), plain (1 + 4), speculation (1 + 4)
    assert heavy[:15] == ["spec"] * 5 + ["plain"] * 5 + ["spec"] * 5
    # then plain runs; the next brackets come after 16 counted steps of the running arm, 16 again, then
    # (a clear winner from the third comparison on: past 2 % by more than its standard error) after
    # 32, 64, 128, each exploring for a switch step and a window of 4
    assert [i + 1 for i, a in enumerate(heavy) if i >= 15 and a == "spec"] == [
        *range(33, 38), *range(59, 64), *range(101, 106), *range(175, 180), *range(313, 318)]
    assert [i + 1 for i, a in enumerate(light) if i >= 15 and a == "plain"] == [
        *range(32, 37), *range(58, 63), *range(100, 105), *range(174, 179), *range(312, 317)]
    close = _feed(gate, 4, {"spec": 100, "plain": 101}, 200)         # plain is 1 % faster: run plain,
    spec_runs = "".join("s" if a == "spec" else "." for a in close[15:]).split(".")
    # and keep checking a near-tie: every 26 steps (16 counted, then a bracket of 5 explored and 5 back)
    assert [len(r) for r in spec_runs if r] == [5] * 7
    kept = LiveGate(inner, explore_every=16, margin=0.05, hurdle=0.0, explore_budget=0.0)  # a margin keeps spec on
    kept_arms = _feed(kept, 4, {"spec": 100, "plain": 103}, 200)
    # 2.9 % behind is within 2 % of the margin's threshold (0.952): a near-tie, explored every 26 steps
    assert kept.describe()["4"]["running"] == "spec" and kept_arms[15:].count("plain") == 7 * 5
    d = gate.describe()
    assert d["16"]["plain"]["tok_s"] == 150.0 and d["16"]["running"] == "plain"
    assert d["16"]["spec_vs_plain"] == 0.6 and d["1"]["spec_vs_plain"] == 1.125 and d["4"]["running"] == "plain"
    assert gate.bucket(5) == gate.bucket(8) == 8 and gate.bucket(1) == 1



def _simulate(gate, steps, spec, plain, rows=4):
    """Runs ``gate`` for ``steps`` steps; ``spec(i, switched)`` / ``plain(i, switched)`` give a step's
    (tokens, seconds). Returns the arms run."""
    arms, prev = [], None
    for i in range(steps):
        gate.plan(list(range(rows)), [None] * rows)
        arm = gate.last_arm
        arms.append(arm)
        tokens, seconds = (spec if arm == "spec" else plain)(i, arm != prev)
        prev = arm
        gate.observe(rows, tokens, seconds)
    return arms



def test_live_gate_needs_a_clear_win_to_speculate_beside_other_rows():
    """With more than one row, speculation must beat plain steps by the hurdle (4 % by default): its
    desynchronised rows drain part-full and join one by one, costs the step timing does not see. A 1 %
    lead runs plain at 8 rows (and, clearly below the threshold, is explored less and less often), the
    same lead alone (one row, nothing to desynchronise) keeps speculating, and an 8 % lead at 8 rows wins."""
    tie = LiveGate(None, explore_every=16)
    arms = _feed(tie, 8, {"spec": 101, "plain": 100}, 600)
    d = tie.describe()["8"]
    assert d["running"] == "plain" and d["spec_needs"] == 1.04 and d["spec_vs_plain"] == 1.01
    assert tie.buckets[8].backoff == LiveGate.MAX_BACKOFF and arms[300:].count("spec") <= 2 * 5   # every 256 steps
    alone = LiveGate(None, explore_every=16)
    one = _feed(alone, 1, {"spec": 101, "plain": 100}, 600)
    # (a near-tie there: explored every 26 steps, a switch step and 4 plain ones each time)
    assert alone.describe()["1"]["spec_needs"] == 1.0 and alone.describe()["1"]["running"] == "spec"
    assert one[100:].count("spec") > 0.75 * 500
    lead = LiveGate(None, explore_every=16)
    won = _feed(lead, 8, {"spec": 108, "plain": 100}, 600)
    assert lead.describe()["8"]["running"] == "spec" and won[100:].count("spec") > 450
    assert LiveGate(None, hurdle=0.0).threshold(8) == 0.0
    for bad in ({"hurdle": -0.1}, {"hurdle": 1.0}, {"margin": -1.0}):
        try:
            LiveGate(None, **bad)
        except ValueError as e:
            assert "hurdle" in str(e)
        else:
            raise AssertionError(f"accepted {bad}")



def test_live_gate_is_not_biased_by_noisy_step_times():
    """Plain steps deliver 50 tok/s; speculative steps 48 tokens in 0.5 s or 1.5 s by turns (48 tok/s on
    the whole). The mean of single-step rates (96 and 32 tok/s) would put speculation at 64 tok/s and
    keep it on (a 1.17x estimate); summing tokens and seconds over a window gives the
    true 0.96 and runs plain decoding."""
    gate = LiveGate(None, explore_every=16)
    arms = _simulate(gate, 600, lambda i, s: (48, 0.5 if i % 2 else 1.5), lambda i, s: (50, 1.0))
    d = gate.describe()["4"]
    assert d["running"] == "plain" and d["spec_vs_plain"] == 0.96
    assert arms[100:].count("plain") / 500 > 0.75     # speculation only in explorations (a near-tie: frequent)



def test_live_gate_does_not_count_the_cost_of_switching_arms():
    """Speculation is 15 % faster in steady state, but its first step after plain steps also drafts
    over the tokens those steps added (here: three times as slow). That one-off cost must not make
    the gate think plain decoding is faster."""
    def spec(i, switched):
        return 23, 0.1 * (3.0 if switched else 1.0)

    def plain(i, switched):
        return 20, 0.1

    arms = _simulate(LiveGate(None, explore_every=16), 600, spec, plain)
    assert arms[20:].count("spec") / len(arms[20:]) > 0.9



def test_live_gate_keeps_greedy_output_exact():
    from serving_helpers import make_tiny_target
    t = make_tiny_target()
    params = SamplingParams(max_new_tokens=30)
    prompts = [[5, 9, 33, 2], list(range(10, 30)), [7, 7, 8, 7], [40, 41, 3]]
    gate = LiveGate(ScheduledPolicy({1: SPSTable((10.0, 9.9, 9.8, 9.7, 9.6))}, k=4), explore_every=3, window=1)
    reqs = [SpecRequest(i, p, params, SelfDraftProposer(t.runner)) for i, p in enumerate(prompts)]
    steps = []
    orig = gate.plan

    def plan(keys, survs):
        out = orig(keys, survs)
        gate.observe(len(keys), len(keys) * (2 if gate.last_arm == "spec" else 1), 0.01 * (1 + len(steps) % 3))
        steps.append(out)
        return out
    gate.plan = plan
    done = run_requests(t.runner, reqs, gate, max_batch=4)
    for r in done:
        assert r.tokens == generate(t.runner, prompts[r.key], params).token_ids
    assert any(not any(s) for s in steps) and any(any(s) for s in steps)    # both arms ran



def test_live_gate_is_not_fooled_by_a_machine_that_slows_down():
    """Speculation is 1.2x faster throughout, but the shared machine runs at half speed for a while,
    then drifts back up step by step. Each comparison brackets the explored window with the running
    arm's windows just before and after it, so the gate stays on speculation through both."""
    def speed(i):
        return 2.0 if 150 <= i < 400 else (1.0 + (600 - i) / 200 if 400 <= i < 600 else 1.0)
    arms = _simulate(LiveGate(None, explore_every=16), 800, lambda i, s: (48, speed(i)), lambda i, s: (40, speed(i)),
                     rows=1)
    after = arms[15:]
    assert after.count("spec") / len(after) > 0.9
    # plain runs only in exploring windows (a switch step and 4), at least 16 steps apart: no switching
    # back and forth in the slow spell
    plain_runs = "".join("p" if a == "plain" else "." for a in after).split(".")
    assert {len(r) for r in plain_runs if r} == {5}



def test_a_new_bucket_above_one_settled_on_plain_starts_plain():
    """More rows never make speculation pay more: once 4 rows settled on plain steps, 8 rows start on
    plain and explore speculation only after explore_every steps (no costly bracket at once)."""
    gate = LiveGate(None, explore_every=16)
    _feed(gate, 4, {"spec": 90, "plain": 150}, 40)
    assert gate.describe()["4"]["running"] == "plain"
    eight = _feed(gate, 8, {"spec": 90, "plain": 150}, 40)
    assert eight[:16] == ["plain"] * 16 and eight[16] == "spec"
    alone = LiveGate(None, explore_every=16)                      # nothing known below: start speculating
    assert _feed(alone, 8, {"spec": 90, "plain": 150}, 5) == ["spec"] * 5



def test_live_gate_backs_off_a_clear_noisy_gap_and_keeps_a_noisy_lead():
    """A noisy 2.7 % gap, once clear past 2 % beyond its standard error, is explored less and less often;
    a noisy lead of speculation (the one-row case) keeps speculation on."""
    noisy = LiveGate(None, explore_every=16)
    arms = _simulate(noisy, 1200, lambda i, s: (100 if i % 3 else 92, 1.0), lambda i, s: (100, 1.0))  # 0.973
    d = noisy.describe()["4"]
    assert d["running"] == "plain" and noisy.buckets[4].backoff == LiveGate.MAX_BACKOFF
    assert arms[600:].count("spec") <= 10
    lead = LiveGate(None, explore_every=16)
    arms = _simulate(lead, 1200, lambda i, s: (112 if i % 4 else 90, 1.0), lambda i, s: (100 if i % 5 else 110, 1.0),
                     rows=1)                                               # speculation about 6 % ahead
    assert lead.describe()["1"]["running"] == "spec" and arms[100:].count("spec") / 1100 > 0.95



def test_a_near_tie_above_a_clearly_plain_bucket_runs_plain_and_explores_as_rarely():
    """More rows never make speculation pay more: once 4 rows clearly settled on plain steps (backoff on),
    8 rows with a near-tie (speculation 1 % ahead, within noise) run plain and explore no more often than
    4 rows do; a clear lead of speculation at 8 rows still wins it back."""
    gate = LiveGate(None, explore_every=16, hurdle=0.0)
    _feed(gate, 4, {"spec": 90, "plain": 150}, 1000)
    assert gate.describe()["4"]["running"] == "plain" and gate.buckets[4].backoff == LiveGate.MAX_BACKOFF
    eight = _feed(gate, 8, {"spec": 101, "plain": 100}, 600)
    assert eight.count("spec") <= 2 * 5                 # a bracket every 16 << 4 = 256 counted steps
    assert gate.describe()["8"]["running"] == "plain"
    alone = LiveGate(None, explore_every=16, hurdle=0.0)  # without the clear verdict below (nor a hurdle),
    near = _feed(alone, 8, {"spec": 101, "plain": 100}, 600)       # the near-tie runs speculation
    assert near.count("spec") > 450
    clear = LiveGate(None, explore_every=16)
    _feed(clear, 4, {"spec": 90, "plain": 150}, 400)
    won = _feed(clear, 8, {"spec": 130, "plain": 100}, 3000)
    assert clear.describe()["8"]["running"] == "spec" and won[-500:].count("spec") > 450



def test_live_gate_prices_its_brackets_and_explores_a_costly_loser_rarely():
    """Exploring speculation where plain steps clearly win costs a switch step that drafts over the tokens the
    plain steps added (here 3x a plain step) and a window of slow steps: 1.6 + 2.4 = 4 plain steps lost per
    bracket. With a 2 % budget the next bracket waits 4 / 0.02 = 200 counted steps (not 48, then 96 ...), so
    the gate loses at most about 2 % to its checks; a near-tie costs almost nothing and is still checked every
    48 steps; a bucket above explores no more often; and the budget only spaces brackets, never decides."""
    def spec(i, switched):
        return 90, 3.0 if switched else 1.0

    def plain(i, switched):
        return 150, 1.0

    def run(gate, steps=3000, rows=8):
        arms, secs, toks, prev = [], 0.0, 0, None
        for i in range(steps):
            gate.plan(list(range(rows)), [None] * rows)
            arm = gate.last_arm
            t, s = (spec if arm == "spec" else plain)(i, arm != prev)
            prev = arm
            gate.observe(rows, t, s)
            arms.append(arm)
            secs, toks = secs + s, toks + t
        return arms, toks / secs / 150.0

    priced = LiveGate(None)
    arms, share = run(priced)
    d = priced.describe()["8"]
    assert d["running"] == "plain" and d["bracket_cost_steps"] == 4.0 and d["explore_interval"] >= 200
    # (the first bracket runs at once, from speculation; the first priced one after 48 plain steps)
    starts = [i for i in range(1, len(arms)) if arms[i] == "spec" and arms[i - 1] == "plain"][1:]
    assert len(starts) >= 3 and all(b - a >= 200 for a, b in zip(starts, starts[1:]))
    assert share > 0.98
    # over a short spell (a server's load level of a few hundred steps) the bare backoff (48, 48, then
    # doubling once three comparisons agree) explores more and loses more
    short, short_share = run(LiveGate(None), steps=600)
    free = LiveGate(None, explore_budget=0.0)
    free_arms, free_share = run(free, steps=600)
    assert free.describe()["8"]["running"] == "plain"
    assert short_share > free_share and short.count("spec") < free_arms.count("spec")
    above = run(priced, steps=400, rows=16)[0]                  # 16 rows: no bracket before 8 rows' interval
    assert above[:200] == ["plain"] * 200
    tie = LiveGate(None, hurdle=0.0)                             # spec 1 % behind: a cheap bracket
    _feed(tie, 8, {"spec": 100, "plain": 101}, 600)
    t = tie.describe()["8"]
    assert t["running"] == "plain" and t["explore_interval"] == 48 and t["bracket_cost_steps"] < 0.1
    winner = LiveGate(None)                                     # the price never keeps a faster arm from running
    won = _feed(winner, 8, {"spec": 130, "plain": 100}, 600)
    assert winner.describe()["8"]["running"] == "spec" and won[100:].count("spec") > 450
    try:
        LiveGate(None, explore_budget=1.0)
    except ValueError as e:
        assert "explore_budget" in str(e)
    else:
        raise AssertionError("accepted explore_budget=1.0")


def test_the_length_gate_keeps_whichever_of_scheduled_and_verify_all_is_faster():
    """Inside the live gate, the scheduler's verify lengths run against verifying every drafted token;
    the faster measured runs. The outer gate's plain steps count for neither."""
    from dspark_core.scheduling import LengthRule, make_length_gate
    one = LengthRule("one", lambda survs, limits: [min(1, m) for m in limits])
    for faster, rates in (("verify_all", {"scheduled": 100, "verify_all": 110, "plain": 90}),
                          ("scheduled", {"scheduled": 110, "verify_all": 100, "plain": 90})):
        lengths_gate = make_length_gate(one, explore_budget=0.0, explore_every=16)
        gate = LiveGate(lengths_gate, explore_every=16, hurdle=0.0, explore_budget=0.0)
        ran = []
        for _ in range(400):
            plan = gate.plan(list(range(4)), [None] * 4)
            if gate.last_arm == "plain":
                assert not any(plan)
                arm = "plain"
            else:
                assert all(plan)
                arm = "verify_all" if gate([None] * 4, [4] * 4) == [4] * 4 else "scheduled"
            ran.append(arm)
            gate.observe(4, rates[arm], 1.0)
        d = gate.describe()["4"]
        assert d["running"] == "spec" and d["lengths"]["running"] == faster
        assert ran[100:].count(faster) > 0.8 * 300
        inner_steps = d["lengths"]["scheduled"]["steps"] + d["lengths"]["verify_all"]["steps"]
        assert inner_steps == len(ran) - ran.count("plain") and ran.count("plain") > 0
        assert d["lengths"]["scheduled_vs_verify_all"] is not None


def test_the_length_gate_keeps_greedy_output_exact():
    from serving_helpers import make_tiny_target
    from dspark_core.scheduling import make_length_gate
    t = make_tiny_target()
    params = SamplingParams(max_new_tokens=30)
    prompts = [[5, 9, 33, 2], list(range(10, 30)), [7, 7, 8, 7], [40, 41, 3]]
    inner = make_length_gate(ScheduledPolicy({1: SPSTable((10.0, 9.9, 9.8, 9.7, 9.6))}, k=4), explore_every=2,
                             window=1, explore_budget=0.0)
    gate = LiveGate(inner, explore_every=3, window=1, explore_budget=0.0)
    reqs = [SpecRequest(i, p, params, SelfDraftProposer(t.runner)) for i, p in enumerate(prompts)]
    arms = []

    def observe(rows, tokens, seconds, _o=gate.observe):
        arms.append((gate.last_arm, inner.last_arm))
        _o(rows, tokens, 0.01 * (1 + len(arms) % 3))
    gate.observe = observe
    done = run_requests(t.runner, reqs, gate, max_batch=4)
    for r in done:
        assert r.tokens == generate(t.runner, prompts[r.key], params).token_ids
    assert {a for a, _ in arms} == {"spec", "plain"} and {b for a, b in arms if a == "spec"} == {"spec", "plain"}
