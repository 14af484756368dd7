"""Verify-length scheduling: SPS(B) throughput curves, the scheduled policy and the live gate.

A policy maps each request's survival probabilities (from the calibrated confidence head) to how many
draft tokens that request verifies this step; the engine's loops call it once per step. Every policy
here implements :class:`~dspark_core.engine.policy.VerifyPolicy` (re-exported), the contract the engine
defines.
"""

from dspark_core.engine.policy import LengthRule, PolicyDefaults, VerifyPolicy
from dspark_core.scheduling.live_gate import GATE_EXPLORE_BUDGET, GATE_HURDLE, LiveGate, make_length_gate
from dspark_core.scheduling.policy import (SPSTable, ScheduledPolicy, StepCost, causal_greedy, fixed_lengths,
                                           global_search_capacity, make_policy, scheduled_lengths,
                                           survival_from_probs, threshold_lengths, top_k_lengths)

__all__ = ["GATE_EXPLORE_BUDGET", "GATE_HURDLE", "LengthRule", "LiveGate", "PolicyDefaults", "SPSTable",
           "ScheduledPolicy", "StepCost", "VerifyPolicy", "causal_greedy", "fixed_lengths",
           "global_search_capacity", "make_length_gate", "make_policy", "scheduled_lengths", "survival_from_probs",
           "threshold_lengths", "top_k_lengths"]
