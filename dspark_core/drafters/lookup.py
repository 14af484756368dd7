"""Prompt lookup first, the model drafter otherwise (``--drafter dspark-lookup``).

Where the text repeats itself (chat answers that restate the question, code that repeats identifiers,
a small target whose greedy output loops), copying what followed the latest earlier occurrence of the
current suffix costs nothing and is often right; elsewhere the DSpark drafter proposes. Per round and per
request: when the last ``min_match`` or more tokens (anchor included) occurred earlier in prompt +
output, the draft is the copy; otherwise the wrapped drafter drafts. A copy carries confidences from
the copies' observed acceptance per position (``calibrated`` drafts: the logit of P(position j accepted
| j - 1 accepted), a Beta(1, 1) prior, counted over every copy this proposer made), so under load the
scheduler trims copies like model drafts instead of verifying each at full length. The label of a
copied position the target did not verify (the scheduler cut the copy short) is whether the target's
own next token equals it, which is what verifying it would have decided for greedy decoding and has
the same expectation when sampling, so trimming does not bias the estimate downwards. The confidences
depend only on earlier rounds, never on this round's tokens, so the length choice stays exact. The
drafter sees every committed token either way (its context features are appended at commit and absorbed
at its next draft), so switching costs nothing. Lossless like every proposer: verification decides, the draft only proposes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark_core.engine.sampling import SamplingParams
from dspark_core.engine.proposer import Draft, propose_many
from dspark_core.drafters.ngram import ngram_lookup


@dataclass
class _LookupState:
    inner: object
    history: list[int]
    copy: list[int] | None = None        # the last round's copy, until its outcome is known
    accepted: int = 0                    # how many of it the target accepted (set at commit)


class LookupFirstProposer:
    def __init__(self, inner, min_match: int = 2, max_match: int = 4):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.inner = inner
        self.name = f"{inner.name}-lookup"
        self.tap_layers = tuple(inner.tap_layers)
        self.min_match, self.max_match = min_match, max_match
        self.fingerprint = getattr(inner, "fingerprint", None)
        self.lookups = 0            # rounds drafted by lookup / by the model (for reports)
        self.model_drafts = 0
        n = max(1, int(inner.max_block))
        self.copy_reached = [0] * n     # per position: copies whose earlier positions were all accepted
        self.copy_accepted = [0] * n    # ... and this position too

    def copy_confidence(self, k: int) -> torch.Tensor:
        """Logits of P(copied position j accepted | the ones before accepted), j < k (Beta(1, 1) prior)."""
        out = []
        for j in range(k):
            j_ = min(j, len(self.copy_reached) - 1)
            p = (self.copy_accepted[j_] + 1) / (self.copy_reached[j_] + 2)
            out.append(math.log(p / (1 - p)))
        return torch.tensor(out)

    def _learn(self, state: _LookupState, anchor: int) -> None:
        """The last round's copy met the target: positions before ``accepted`` were accepted, the next
        one is labelled by the target's token there (the anchor of this round)."""
        copy, n = state.copy, state.accepted
        state.copy = None
        if not copy:
            return
        for j in range(min(n + 1, len(copy), len(self.copy_reached))):
            self.copy_reached[j] += 1
            self.copy_accepted[j] += 1 if j < n else int(copy[j] == anchor)

    @property
    def max_block(self) -> int:
        return self.inner.max_block

    @max_block.setter
    def max_block(self, k: int) -> None:
        self.inner.max_block = k

    def start(self, prompt_ids: list[int], taps: torch.Tensor | None) -> _LookupState:
        return _LookupState(self.inner.start(prompt_ids, taps), list(prompt_ids))

    def _lookup(self, state: _LookupState, anchor: int, k: int) -> list[int]:
        return ngram_lookup(state.history + [anchor], min(k, self.max_block), self.max_match, self.min_match)

    def propose(self, state: _LookupState, anchor: int, k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        return self.propose_batch([state], [anchor], [k], [params], [generator])[0]

    def propose_batch(self, states: list[_LookupState], anchors: list[int], ks: list[int],
                      params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[Draft]:
        out: list[Draft | None] = [None] * len(states)
        ks_model = list(ks)
        for i, (s, a, k) in enumerate(zip(states, anchors, ks)):
            self._learn(s, a)
            if k <= 0:
                out[i] = Draft(torch.empty(0, dtype=torch.long))
                continue
            copy = self._lookup(s, a, k)
            if copy:
                out[i] = Draft(torch.tensor(copy, dtype=torch.long), confidence_logits=self.copy_confidence(len(copy)),
                               calibrated=True)
                s.copy = copy
                ks_model[i] = 0
                self.lookups += 1
        rest = [i for i, k in enumerate(ks_model) if k > 0]
        if rest:
            got = propose_many(self.inner, [states[i].inner for i in rest], [anchors[i] for i in rest],
                               [ks_model[i] for i in rest], [params[i] for i in rest], [generators[i] for i in rest])
            for i, d in zip(rest, got):
                out[i] = d
            self.model_drafts += len(rest)
        return out

    def commit(self, state: _LookupState, tokens: list[int], taps: torch.Tensor | None) -> None:
        if state.copy is not None:
            state.accepted = len(tokens) - 1          # the anchor, then the accepted part of the copy
        state.history.extend(tokens)
        self.inner.commit(state.inner, tokens, taps)
