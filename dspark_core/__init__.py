"""dspark_core: the DSpark algorithm, pure torch.

Glossary (names used everywhere in this package):

- target: the frozen served LLM whose output distribution must be reproduced exactly.
- drafter / proposer: anything that proposes draft tokens (DSpark, DFlash, Eagle3-style, n-gram).
- anchor: the last token already chosen by the target; slot 0 of a draft block, first row of a verify.
- draft tokens: tokens proposed by the drafter for the positions after the anchor.
- draft_probs: the fp32 distribution each draft token was sampled from ([k, vocab]).
- target_probs: the fp32 distribution of the target at each verify row ([k + 1, vocab]).
- accepted tokens: the leading run of draft tokens that passed rejection sampling.
- recovered token: the token sampled from the residual max(target_probs - draft_probs, 0) at the first
  rejected position.
- bonus token: the token sampled from the target at the row after the last draft when every draft was
  accepted.
- tau: mean number of tokens committed per speculative round (accepted drafts + the recovered/bonus
  token).
- round: one speculative step of a request: draft a block, verify it, commit the accepted prefix plus
  one target token.
- block, gamma (γ, ``block_size``, G in shapes): the draft block, anchor + γ - 1 slots drafted in one
  backbone pass; a round verifies at most γ - 1 drafts.
- slot: a position inside a block, 0-based (slot i predicts the token i + 1 after the anchor).
- DSpark / DFlash: the block drafter with / without its Markov head (each slot conditioned on the
  previous slot's token) and confidence head; Eagle3: a one-layer autoregressive drafter, one token
  per pass.
- confidence logits: the drafter's per-slot logit that the slot's token will be accepted ([k]).
- survival: the probability that draft slots 1..k are all accepted, the cumulative product of the
  calibrated per-slot confidences.
- STS: Sequential Temperature Scaling, the per-position temperature (and shift) that calibrates
  survival; ECE (expected calibration error) measures the result.
- shadow round: a round that verifies the whole drafted block whatever the policy chose, so its labels
  are uncensored calibration data.
- verify length: how many drafts of a block a round sends to the target, chosen by the verify policy.
- SPS(B): engine steps per second when a step verifies B tokens over the batch (``SPSTable``); the
  scheduled policy trades expected accepted tokens against it.
- live gate: the per-concurrency switch that turns speculation off where it measures slower than plain
  decoding.
- plain step: one target forward of one token per row, no drafting (the baseline speedups divide by).
- draft vocabulary (Vd): the trimmed set of token ids a drafter can propose; target probabilities
  restricted to it stay normalised over the full vocabulary V.
- committed length: the KV-cache positions of a row that hold accepted tokens; rollback only moves it
  back.
- ragged / packed: a batched step whose rows carry different numbers of tokens; packed, only the real
  tokens are computed and returned ([N, ...]).
- taps: raw residual-stream outputs of chosen target decoder layers, the drafter's context features.
- fingerprint: sha256 of a target's config and weights; every drafter artifact carries the one it was
  trained against.
- held-out split: prompts kept out of training for evaluation; a prompt's side is fixed once recorded.

Shapes are written as comments, e.g. ``# [batch, k, vocab]``.
"""

__version__ = "0.1.0"
