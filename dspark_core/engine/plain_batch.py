"""Plain (non-speculative) batched generation with continuous refill, for building traces.

Each request has its own sampling parameters and generator, so its output does not depend on which
other requests share the batch (up to bf16 rounding of batched matmuls). A finished row is refilled with
the next waiting prompt between steps.

Two things keep the rows busy on real prompt mixes (ShareGPT first turns run from a few tokens to 850):
prompts start longest first, so rows that step together have similar lengths and attention is not
padded to one long outlier; and once no prompt waits, the batch is compacted whenever half its rows
have finished, so the tail does not step idle rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from dspark_core.model.runner import ForwardOutput, TargetRunner
from dspark_core.engine.sampling import SamplingParams, draw


@dataclass
class BatchRequest:
    key: object                   # caller's id, handed back with the result
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass
class BatchResult:
    key: object
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str            # "stop" or "length"


def generate_batch(runner: TargetRunner, requests: Iterable[BatchRequest], batch_size: int = 8,
                   on_result: Callable[[BatchResult], None] | None = None,
                   on_token: Callable[[int], None] | None = None, capture=None,
                   prefill_tokens: int = 2048) -> list[BatchResult]:
    """Generate for every request, ``batch_size`` rows at a time; results come back in finish order.

    Prompts that start together (the first ``batch_size``, and those refilling rows freed in the same
    step) are prefilled together, in packed forwards of at most ``prefill_tokens`` padded tokens: one
    pass over the weights for many prompts, where one prompt at a time streams them once each.
    ``capture`` (a :class:`~dspark_core.data.features.FeatureCapture`) keeps the target features these forwards
    compute anyway (its tap layers, final hidden states, log-normalisers) and stores each finished
    sequence's; the tokens generated do not change."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if prefill_tokens < 1:
        raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
    queue = sorted(requests, key=lambda r: len(r.prompt_ids))     # popped from the end: longest first
    for req in queue:
        if not req.prompt_ids:
            raise ValueError(f"request {req.key!r} has an empty prompt")
    results: list[BatchResult] = []
    if not queue:
        return results
    n_rows = min(batch_size, len(queue))
    longest = max(len(r.prompt_ids) + r.params.max_new_tokens for r in queue)
    cache = runner.new_cache(n_rows, longest + 2)
    active: list[tuple[BatchRequest, list[int]] | None] = [None] * n_rows
    taps = capture.taps if capture is not None else ()
    hidden = capture is not None

    def fill(rows: list[int]) -> None:
        """Start waiting prompts on the free ``rows``; a request done at its first token frees its row again."""
        free = list(rows)
        while free and queue:
            group: list[tuple[int, BatchRequest]] = []        # longest first: the first sets the padded length
            while free and queue and (not group or (len(group) + 1) * len(group[0][1].prompt_ids) <= prefill_tokens):
                group.append((free.pop(0), queue.pop()))
            lens = [len(req.prompt_ids) for _, req in group]
            width = lens[0]
            for row, _ in group:
                cache.truncate(row, 0)
            ids = torch.tensor([req.prompt_ids + [0] * (width - n) for (_, req), n in zip(group, lens)])
            out = runner.forward(cache, ids, rows=[row for row, _ in group], logits="last", taps=taps,
                                 want_last_hidden=hidden, lengths=lens)
            for b, ((row, req), n) in enumerate(zip(group, lens)):
                if capture is not None:
                    capture.prefill(req.key, ForwardOutput(None, out.taps[b:b + 1, :n] if taps else None,
                                                           out.last_hidden[b:b + 1, :n]))
                first = int(draw(out.logits[b, -1], req.params, req.generator)[0])
                if on_token:
                    on_token(1)
                if first in req.params.stop_token_ids or req.params.max_new_tokens == 1:
                    finish(BatchResult(req.key, req.prompt_ids, [first],
                                       "stop" if first in req.params.stop_token_ids else "length"))
                    active[row] = None
                    free.append(row)
                else:
                    active[row] = (req, [first])
        for row in free:
            active[row] = None

    def finish(res: BatchResult) -> None:
        if capture is not None:
            capture.finish(res.key, res.prompt_ids, res.token_ids)
        results.append(res)
        if on_result:
            on_result(res)

    fill(list(range(n_rows)))
    while any(a is not None for a in active):
        busy = [r for r, a in enumerate(active) if a is not None]
        if not queue and 2 * len(busy) <= len(active):          # the tail: drop the finished rows
            cache.keep_rows(busy)
            active = [active[r] for r in busy]
        # Every row steps (an idle row feeds a dummy token and is rolled back): a full-batch forward
        # writes the cache in place, where a subset of rows would copy it.
        ids = torch.tensor([[a[1][-1] if a is not None else 0] for a in active])
        out = runner.forward(cache, ids, logits="all", taps=taps, want_last_hidden=hidden)
        freed = []
        for r, a in enumerate(active):
            if a is None:
                cache.truncate(r, cache.lengths[r] - 1)
                continue
            req, toks = a
            if capture is not None:
                capture.step(req.key, out, r)
            tok = int(draw(out.logits[r, 0], req.params, req.generator)[0])
            toks.append(tok)
            if on_token:
                on_token(1)
            stop = tok in req.params.stop_token_ids
            if stop or len(toks) >= req.params.max_new_tokens:
                finish(BatchResult(req.key, req.prompt_ids, toks, "stop" if stop else "length"))
                active[r] = None
                freed.append(r)
        if freed and queue:
            fill(freed)
    return results
