"""Eagle3-style drafter: one autoregressive decoder layer on fused multi-layer target features.

Input at position p is fc_in([embed(token p+1) ; feature p]); the feature is the fused target taps for
committed positions and the drafter's own previous output for speculative steps. Its output at p,
through the frozen target head, predicts token p+2. The drafter keeps its own KV cache; speculative
entries are rolled back after each round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dspark_core.model.layers import KVCache, Rotary, pack_linears, rms_norm
from dspark_core.engine.sampling import SamplingParams, draw
from dspark_core.engine.proposer import Draft
from dspark_core.drafters.modules import DraftHead, DraftLayer, DrafterConfig, init_weights


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.fc_in = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(d))
        self.head = DraftHead(cfg, lm_head)
        self.register_buffer("embed", embed, persistent=False)
        init_weights(self)
        self._rotary: Rotary | None = None

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, dev = self.fc.weight.dtype, self.fc.weight.device
        if self._rotary is None or self._rotary.dtype != dtype or self._rotary.device != dev:
            self._rotary = Rotary.default(self.cfg.head_dim, self.cfg.rope_theta, dtype=dtype, device=dev)
        cos, sin = self._rotary.tables(positions)
        return cos[:, None], sin[:, None]

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, n_taps * d] -> fused features [B, T, d]."""
        return self.fc(taps.to(self.fc.weight.dtype))

    def step_inputs(self, next_tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """next_tokens [B, T], feats [B, T, d] -> layer inputs [B, T, d]."""
        e = self.embed[next_tokens].to(feats.dtype)
        return self.fc_in(torch.cat([e, feats], dim=-1))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Layer output [..., d] -> fp32 draft-vocab logits [..., Vd]."""
        return self.head.logits(rms_norm(out, self.norm, self.cfg.rms_eps))


@dataclass
class _EagleState:
    cache: KVCache
    history: list[int]                                  # committed tokens (prompt + output)
    pending: list[torch.Tensor] = field(default_factory=list)
    n_done: int = 0                                     # positions whose pairs are in the cache


class Eagle3Proposer:
    def __init__(self, drafter: Eagle3Drafter, fingerprint: str | None = None):
        self.drafter = pack_linears(drafter.eval())     # prepacked weights on CPU; training unaffected
        self.cfg = drafter.cfg
        self.name = "eagle3"
        self.tap_layers = tuple(self.cfg.target_layer_ids)
        self.max_block = self.cfg.block_size
        self.fingerprint = fingerprint

    def start(self, prompt_ids: list[int], taps: torch.Tensor | None) -> _EagleState:
        c, p = self.cfg, self.drafter.fc.weight
        cache = KVCache(c.num_layers, 1, c.num_kv_heads, c.head_dim, len(prompt_ids) + 256, p.dtype, p.device)
        return _EagleState(cache, list(prompt_ids), [taps] if taps is not None else [])

    def commit(self, state: _EagleState, tokens: list[int], taps: torch.Tensor | None) -> None:
        if taps is None or taps.shape[0] != len(tokens):
            raise ValueError(f"commit needs taps [{len(tokens)}, F], got {None if taps is None else tuple(taps.shape)}")
        state.history.extend(tokens)
        state.pending.append(taps)

    def _run(self, state: _EagleState, x: torch.Tensor, p0: int) -> torch.Tensor:
        """Run the layers on inputs x [1, T, d] at positions p0.. (causal, appended to the cache)."""
        T = x.shape[1]
        cos, sin = self.drafter.rope(torch.arange(p0, p0 + T, device=x.device)[None])
        cache = state.cache
        cache.reserve(p0 + T)
        mask = None
        if T > 1:
            kp = torch.arange(p0 + T, device=x.device)
            mask = kp[None, None, None, :] <= torch.arange(p0, p0 + T, device=x.device)[None, None, :, None]
        for li, layer in enumerate(self.drafter.layers):
            ck, cv = cache.k[li, :1, :, :p0], cache.v[li, :1, :, :p0]
            x, k, v = layer(x, cos, sin, ck, cv, mask)
            cache.k[li, 0, :, p0:p0 + T] = k[0]
            cache.v[li, 0, :, p0:p0 + T] = v[0]
        cache.lengths[0] = p0 + T
        return x

    @torch.inference_mode()
    def propose(self, state: _EagleState, anchor: int, k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        k = min(k, self.max_block)
        if k <= 0:
            return Draft(torch.empty(0, dtype=torch.long))
        d = self.drafter
        dev = d.fc.weight.device
        seq = state.history + [anchor]
        start = len(state.history)                       # anchor position
        p0 = state.n_done
        if state.pending:
            feats = d.features(torch.cat(state.pending, dim=0)[None])   # positions p0 .. start-1
            state.pending.clear()
            nxt = torch.tensor(seq[p0 + 1:start + 1], device=dev)[None]
            out = self._run(state, d.step_inputs(nxt, feats), p0)
            state.n_done = start
        else:
            raise RuntimeError("eagle3 proposer has no new target features; was commit() called?")
        last = out[:, -1:]
        tokens, rows = [], []
        pos = start
        for i in range(k):
            local, probs = draw(d.logits(last)[0, 0], params, generator)
            if probs is not None:
                rows.append(probs)
            tok = d.head.to_global(local)
            tokens.append(tok)
            if i + 1 < k:
                last = self._run(state, d.step_inputs(tok.view(1, 1), last), pos)
                pos += 1
        state.cache.lengths[0] = start                   # roll back the speculative entries
        return Draft(torch.stack(tokens).long().cpu(),
                     d.head.to_global_probs(torch.stack(rows)) if rows else None, None)


def eagle3_train_forward(drafter: Eagle3Drafter, taps: torch.Tensor, tokens: torch.Tensor,
                         anchors: torch.Tensor, keep: torch.Tensor, horizon: int) -> torch.Tensor:
    """Training-time test: step 1 runs causally over the whole sequence on real target features; steps
    2..horizon unroll each anchor's chain on the drafter's own outputs, attending to the real-feature
    keys before the anchor plus the chain's own earlier keys, exactly as at inference.

    taps [B, S, F]; tokens [B, S]; anchors [B, A] (>= 1); keep [B, A]. Returns logits [B, A, horizon, Vd]
    where slot i predicts the token at anchor + i + 1.
    """
    B, S, _ = taps.shape
    A = anchors.shape[1]
    dev = taps.device
    feats = drafter.features(taps[:, :-1])                                       # pairs (f_p, t_{p+1})
    x = drafter.step_inputs(tokens[:, 1:], feats)                                # [B, S-1, d]
    P = S - 1
    cos, sin = drafter.rope(torch.arange(P, device=dev)[None])
    causal = (torch.arange(P, device=dev)[None, :] <= torch.arange(P, device=dev)[:, None])[None, None]
    base_k, base_v = [], []
    for layer in drafter.layers:
        x, k, v = layer(x, cos, sin, None, None, causal)
        base_k.append(k)
        base_v.append(v)
    # slot 0 of anchor a reads the step-1 output at position a - 1
    idx = (anchors - 1).clamp(min=0)
    out = x.gather(1, idx[:, :, None].expand(-1, -1, x.shape[-1]))              # [B, A, d]
    logits = [drafter.logits(out)]
    ctx_ok = (torch.arange(P, device=dev)[None, None, :] <= idx[:, :, None]) & keep[:, :, None]  # [B, A, P]
    chain_k = [[] for _ in drafter.layers]
    chain_v = [[] for _ in drafter.layers]
    eye = torch.eye(A, dtype=torch.bool, device=dev)
    for step in range(1, horizon):
        pos = (idx + step)                                                       # [B, A]
        nxt = tokens.gather(1, (anchors + step).clamp(max=S - 1))
        h = drafter.step_inputs(nxt, out)                                        # [B, A, d]
        c2, s2 = drafter.rope(pos)
        mask = torch.cat([ctx_ok] + [eye.expand(B, -1, -1)] * step, dim=-1)[:, None]
        for li, layer in enumerate(drafter.layers):
            ck = torch.cat([base_k[li]] + chain_k[li], dim=2) if chain_k[li] else base_k[li]
            cv = torch.cat([base_v[li]] + chain_v[li], dim=2) if chain_v[li] else base_v[li]
            h, k, v = layer(h, c2, s2, ck, cv, mask)
            chain_k[li].append(k)
            chain_v[li].append(v)
        out = h
        logits.append(drafter.logits(out))
    return torch.stack(logits, dim=2)
