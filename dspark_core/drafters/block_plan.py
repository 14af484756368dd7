"""The batch-1 drafting pass of a block drafter with fused weights (inference only).

A drafting pass is a few tokens through a small model, so on a CPU its cost is set by how many weight
matrices it reads and how many small ops it launches, not by arithmetic. :class:`BlockPlan` holds a
drafter's weights the way the target runner holds the target's: q/k/v fused into one matrix and gate/up
into another (a layer reads 4 packed matrices, not 7), each context feature's key and value projections
fused, the residual stream kept 2-D, the Markov head's tables read without module calls, and the block's own keys and values written into the context cache
after the committed positions (the next absorb overwrites them) instead of concatenated to the whole
context in every layer. It computes the same function as :meth:`BlockDrafter.backbone` and the
context absorb of :class:`~dspark_core.drafters.block.BlockProposer` (tests compare the two); drafts
feed lossless verification either way. The plan is rebuilt when the drafter's weights change
(an optimizer step, ``load_state_dict``, ``.to()``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark_core.model.layers import KVCache, Linear, apply_rope, attention


@dataclass
class _PlanLayer:
    ln1: torch.Tensor
    qkv: Linear                 # [(H + 2 Hkv) * D, d]
    kv: Linear                  # [2 Hkv * D, d]: a context feature's key and value
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear             # [2 I, d]
    down: Linear


def weights_key(params: list[torch.Tensor]) -> tuple:
    """Changes whenever any of ``params`` is written in place, cast or moved (a parameter object replaced
    by another is not seen: callers keep the module's own parameter list)."""
    return tuple((p.data_ptr(), p._version) for p in params)


class BlockPlan:
    """Fused inference weights of a :class:`~dspark_core.drafters.block.BlockDrafter` (see the module)."""

    def __init__(self, drafter):
        c = drafter.cfg
        # what the plan is built from: the parameters and the draft vocabulary (a persistent buffer)
        self.params = list(drafter.parameters()) + [drafter.head.vocab_ids]
        self.key = weights_key(self.params)
        self.cfg = c
        w = lambda lin: lin.weight.detach()                                     # noqa: E731
        self.layers = [
            _PlanLayer(ln1=L.ln1.detach(),
                       qkv=Linear(torch.cat([w(L.q_proj), w(L.k_proj), w(L.v_proj)], 0)),
                       kv=Linear(torch.cat([w(L.k_proj), w(L.v_proj)], 0)),
                       q_norm=None if L.q_norm is None else L.q_norm.detach(),
                       k_norm=None if L.k_norm is None else L.k_norm.detach(),
                       o=Linear(w(L.o_proj)), ln2=L.ln2.detach(),
                       gate_up=Linear(torch.cat([w(L.gate_proj), w(L.up_proj)], 0)), down=Linear(w(L.down_proj)))
            for L in drafter.layers]
        self.fc = Linear(w(drafter.fc))
        self.hidden_norm = drafter.hidden_norm.detach()
        self.norm = drafter.norm.detach()
        self.markov_in = self.markov_in_draft = self.markov_out = None
        if drafter.markov_in is not None:
            self.markov_in = drafter.markov_in.weight.detach()                    # [V, r] by target id
            # the rows of the draft vocabulary by draft id: the Markov loop feeds a drawn token back
            # without mapping it to its target id first
            self.markov_in_draft = self.markov_in[drafter.head.vocab_ids] if drafter.head.trimmed else self.markov_in
            self.markov_out = Linear(w(drafter.markov_out))                      # [Vd, r]

    def absorb(self, drafter, taps: torch.Tensor, positions: torch.Tensor):
        """Target features taps [M, F] at ``positions`` [M] -> (fused features [M, d], per layer the rope'd
        keys and the values [M, Hkv, D]). Every op acts per position, so many requests' features can be
        concatenated into one call."""
        c = self.cfg
        d, Hkv, D, eps = c.hidden_size, c.num_kv_heads, c.head_dim, c.rms_eps
        ctx = F.rms_norm(self.fc(taps.to(self.hidden_norm.dtype)), (d,), self.hidden_norm, eps)   # [M, d]
        M = ctx.shape[0]
        cos, sin = drafter.rotary().tables(positions)
        cos, sin = cos[:, None], sin[:, None]                                    # [M, 1, D]
        ks, vs = [], []
        for L in self.layers:
            kv = L.kv(F.rms_norm(ctx, (d,), L.ln1, eps) if c.context_norm else ctx).view(M, 2 * Hkv, D)
            k = kv[:, :Hkv]
            if L.k_norm is not None:
                k = F.rms_norm(k, (D,), L.k_norm, eps)
            ks.append(apply_rope(k, cos, sin))
            vs.append(kv[:, Hkv:])
        return ctx, ks, vs

    def _qkv(self, L: _PlanLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, d] -> q [N, H, D] and k [N, Hkv, D] (normed where the target has q/k norms, rope'd), v."""
        c = self.cfg
        H, Hkv, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_eps
        qkv = L.qkv(F.rms_norm(x, (c.hidden_size,), L.ln1, eps)).view(x.shape[0], H + 2 * Hkv, D)
        qk = qkv[:, :H + Hkv]                                                    # q and k heads together
        if L.q_norm is not None:
            qk = torch.cat([F.rms_norm(qk[:, :H], (D,), L.q_norm, eps), F.rms_norm(qk[:, H:], (D,), L.k_norm, eps)], 1)
        qk = apply_rope(qk, cos, sin)                                            # one rope for q and k
        return qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]

    def _rest(self, L: _PlanLayer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The layer after attention: x [N, d] + o(att [N, H * D]), then the MLP with its residual."""
        x = L.o.add_to(x, att)
        gate, up = L.gate_up(F.rms_norm(x, (self.cfg.hidden_size,), L.ln2, self.cfg.rms_eps)).chunk(2, dim=-1)
        return L.down.add_to(x, F.silu(gate) * up)

    def backbone(self, drafter, x: torch.Tensor, cache: KVCache, n: int) -> torch.Tensor:
        """x [G, d] block inputs at positions n..n+G-1 after n cached context positions -> final-normed
        h [G, d]. The block's keys/values go to cache positions n..n+G-1 (past the committed length)."""
        c = self.cfg
        G = x.shape[0]
        cache.reserve(n + G)
        cos, sin = drafter.rotary().tables(torch.arange(n, n + G, device=x.device))
        cos, sin = cos[:, None], sin[:, None]                                    # [G, 1, D]
        for li, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, cos, sin)
            kc, vc = cache.k[li], cache.v[li]
            kc[0, :, n:n + G] = k.transpose(0, 1)
            vc[0, :, n:n + G] = v.transpose(0, 1)
            att = attention(q.transpose(0, 1)[None], kc[:1, :, :n + G], vc[:1, :, :n + G], None)  # block + context
            x = self._rest(L, x, att[0].transpose(0, 1).reshape(G, -1))
        return F.rms_norm(x, (c.hidden_size,), self.norm, c.rms_eps)

    def backbone_rows(self, drafter, x: torch.Tensor, positions: torch.Tensor, ctx_k: list[torch.Tensor],
                      ctx_v: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """Many requests' blocks in one pass: x [B, G, d] at ``positions`` [B, G]; per layer the context
        keys/values [B, Hkv, C, D] (padded to the longest context) and an additive ``mask`` [B, 1, G', C + G]
        (folded for grouped-query attention) -> final-normed h [B, G, d]."""
        c = self.cfg
        B, G, d = x.shape
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = drafter.rotary().tables(positions.reshape(-1))
        cos, sin = cos[:, None], sin[:, None]                                    # [B * G, 1, D]
        x = x.reshape(B * G, d)
        for L, ck, cv in zip(self.layers, ctx_k, ctx_v):
            q, k, v = self._qkv(L, x, cos, sin)
            q = q.view(B, G, H, D).transpose(1, 2)
            kk = torch.cat([ck, k.view(B, G, Hkv, D).transpose(1, 2)], dim=2)
            vv = torch.cat([cv, v.view(B, G, Hkv, D).transpose(1, 2)], dim=2)
            att = attention(q, kk, vv, mask)                                     # [B, H, G, D]
            x = self._rest(L, x, att.transpose(1, 2).reshape(B * G, H * D))
        return F.rms_norm(x, (d,), self.norm, c.rms_eps).view(B, G, d)
