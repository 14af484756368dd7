"""The verify-length policy: the contract between the speculative batch loop and a scheduler.

:class:`~dspark_core.engine.spec_batch.SpecBatch` consults its policy twice per step, and the loop that
drives the batch reports back once:

1. ``plan(keys, prev_survs) -> may_draft``: before drafting, which rows draft at all (a drafting pass
   costs time even when nothing is verified). Sees only the survival of each row's *previous* draft.
2. ``policy(survs, limits) -> lengths``: after drafting, how many draft tokens each row verifies
   (the loop clamps each length to the row's draft). Sees the calibrated survival of this step's draft,
   never its tokens.
3. ``observe(rows, tokens, seconds)``: what the finished step delivered (a live gate learns from it).

Neither decision may depend on the drafted tokens themselves, which is what keeps speculative sampling
exact whatever the policy decides. ``forget(key)`` drops a finished request's per-request state;
``describe()`` and ``speculating()`` report state for operators (admin API, metrics).

The protocol lives with the loop that consumes it, so ``scheduling`` depends on ``engine`` and never the
reverse. :class:`PolicyDefaults` gives the no-op parts to policies that are only a length rule.
"""

from __future__ import annotations

from typing import Callable, Hashable, Protocol, runtime_checkable

import torch

# survival [G_r] per row (None for a row without confidences), max lengths [R] -> lengths [R]
LengthFn = Callable[[list[torch.Tensor | None], list[int]], list[int]]


@runtime_checkable
class VerifyPolicy(Protocol):
    """Per step: who drafts (``plan``), how much each row verifies (``__call__``), what the step gave
    (``observe``). See the module docstring for the order and the exactness rule."""

    def __call__(self, survs: list[torch.Tensor | None], limits: list[int]) -> list[int]:
        """Verify lengths [R] from each row's survival [G_r] (None: the row has no confidences) and its
        drafted length ``limits`` [R]."""
        ...

    def plan(self, keys: list[Hashable], prev_survs: list[torch.Tensor | None]) -> list[bool]:
        """Which of the R rows (request ``keys``) draft this step, from the survival [G_r] of each row's
        previous draft (None: no history yet)."""
        ...

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A finished step: ``rows`` rows ran, ``tokens`` tokens were made in ``seconds``."""
        ...

    def forget(self, key: Hashable) -> None:
        """Request ``key`` left the batch: drop its per-request state."""
        ...

    def describe(self) -> dict | None:
        """JSON-ready live state for operators; None for a policy without any."""
        ...

    def speculating(self) -> bool | None:
        """Whether the step being run speculates, for a policy that can turn speculation off (a live
        gate); None for one that never does. Read after the step and before ``observe``."""
        ...


class PolicyDefaults:
    """No-op defaults for everything but ``__call__``: every row drafts, nothing is learned or kept."""

    def plan(self, keys: list[Hashable], prev_survs: list[torch.Tensor | None]) -> list[bool]:
        return [True] * len(keys)

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        return None

    def forget(self, key: Hashable) -> None:
        return None

    def describe(self) -> dict | None:
        return None

    def speculating(self) -> bool | None:
        return None


class LengthRule(PolicyDefaults):
    """A policy that is only a rule from survival to lengths (``fixed``, ``threshold``, a test's random
    lengths): every row drafts, no step is learned from and no per-request state is kept."""

    def __init__(self, name: str, rule: LengthFn):
        self.name, self.rule = name, rule

    def __call__(self, survs: list[torch.Tensor | None], limits: list[int]) -> list[int]:
        return self.rule(survs, limits)

    def __repr__(self) -> str:
        return f"LengthRule({self.name!r})"


def check_policy(policy: object) -> VerifyPolicy:
    """``policy`` if it implements :class:`VerifyPolicy`, else a TypeError saying how to make it one."""
    if not isinstance(policy, VerifyPolicy):
        raise TypeError(f"a verify-length policy must implement VerifyPolicy (plan, __call__, observe, forget, "
                        f"describe, speculating); got {type(policy).__name__}. Wrap a bare length function "
                        f"as LengthRule(name, fn)")
    return policy
