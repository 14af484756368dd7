"""SPS(B) profiling: monotone, fingerprinted, drafting kept apart from the verify forward."""

from dspark_core.drafters import build_proposer
from tiny_models import tiny_target

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 33, 2], list(range(10, 30)), [7, 7, 8, 7, 7, 8, 7], [40, 41]]


def test_profile_sps_is_monotone_and_fingerprinted(tmp_path):
    from dspark_core.scheduling.sps import load_sps, profile_sps, save_sps
    target = tiny_target("llama", vocab=64, seed=5)
    prop = build_proposer("dspark", target.runner, target.fingerprint, preset="tiny", block_size=3)
    prof = profile_sps(target.runner, prop, max_tokens=6, reps=1, context=16, block=3)
    assert len(prof["sps"]) == 6 and all(a >= b for a, b in zip(prof["sps"], prof["sps"][1:]))
    assert prof["hardware"]["device"] == "cpu"
    path = save_sps(prof, tmp_path / "sps.json")
    assert (tmp_path / "sps.png").exists() and load_sps(path).sps == tuple(prof["sps"])



def test_profile_sps_keeps_drafting_and_the_verify_forward_apart():
    """At a fixed number of rows the profile times the drafting pass and the verify forward apart; the split
    step cost reads one drafting time per number of drafting rows (B = R + n drafts n rows, full blocks)
    and a non-decreasing forward time per B."""
    from dspark_core.scheduling.policy import StepCost
    from dspark_core.scheduling.sps import profile_sps
    target = tiny_target("llama", vocab=64, seed=5)
    prop = build_proposer("dspark", target.runner, target.fingerprint, preset="tiny", block_size=3)
    prof = profile_sps(target.runner, prop, max_tokens=12, reps=1, context=16, block=3, rows=3)
    assert len(prof["draft_seconds"]) == len(prof["forward_seconds"]) == len(prof["sps"]) == 12
    assert prof["draft_seconds"][2] < 0.2 * min(prof["draft_seconds"][3:])   # B = 3: nobody drafts
    cost = StepCost.from_profile(prof)
    assert cost.rows == 3 and len(cost.draft) == 3
    assert all(a <= b for a, b in zip(cost.forward, cost.forward[1:]))
    assert all(a <= b for a, b in zip(cost.draft, cost.draft[1:]))
    assert StepCost.from_profile(profile_sps(target.runner, None, max_tokens=4, reps=1, context=16, rows=2)) is None
