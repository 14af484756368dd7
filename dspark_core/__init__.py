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
- taps: raw residual-stream outputs of chosen target decoder layers, the drafter's context features.
- fingerprint: sha256 of a target's config and weights; every drafter artifact carries the one it was
  trained against.

Shapes are written as comments, e.g. ``# [batch, k, vocab]``.
"""

__version__ = "0.1.0"
