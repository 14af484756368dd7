"""DSpark and DFlash: a parallel block drafter fed with the target's hidden states.

The backbone sees [anchor, mask x (block_size - 1)] at positions anchor..anchor+block_size-1 and
attends, in every layer, to keys/values projected from the fused target features of all committed
positions (strictly before the anchor) plus its own block (bidirectional). Slot i predicts the token at
anchor + i + 1. DSpark adds a low-rank Markov head (a bias on each slot's logits from the previous
draft token) and a confidence head; DFlash is the same backbone without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dspark_core.model.layers import KVCache, Rotary, additive_mask, pack_linears, rms_norm
from dspark_core.engine.sampling import SamplingParams, draw, sample, token_probs
from dspark_core.engine.proposer import Draft
from dspark_core.drafters.block_plan import BlockPlan, weights_key
from dspark_core.drafters.modules import DraftHead, DraftLayer, DrafterConfig, init_weights


class BlockDrafter(nn.Module):
    """Parameters of a DSpark (markov_rank > 0) or DFlash (markov_rank == 0) drafter.

    ``embed`` and ``lm_head`` are the frozen target tensors, shared (not copied, not saved).
    """

    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(d))
        # the mask slots' input: a learned vector, or (reference layout) the frozen embedding row of a token
        self.mask_embedding = nn.Parameter(torch.zeros(d)) if cfg.mask_token_id < 0 else None
        # Our addition (off in the paper's layout): the fused feature of the last committed position,
        # projected into every slot's input, so a small CPU-trained backbone need not first learn to
        # find it by attention. Zero-initialised: training starts from the plain DFlash layout.
        self.context_in = nn.Linear(d, d, bias=False) if cfg.context_input else None
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(d))
        r = cfg.markov_rank
        self.head = DraftHead(cfg, lm_head)
        self.markov_in = nn.Embedding(cfg.vocab_size, r) if r else None          # previous token: any id
        self.markov_out = nn.Linear(r, self.head.size, bias=False) if r else None  # bias over the draft vocab
        self.confidence = nn.Linear(d + r, 1) if cfg.confidence_head else None
        self.register_buffer("embed", embed, persistent=False)      # [vocab, d], frozen target rows
        init_weights(self)
        if self.mask_embedding is not None:
            nn.init.normal_(self.mask_embedding, std=0.02)
        if self.context_in is not None:
            nn.init.zeros_(self.context_in.weight)
        self._rotary: Rotary | None = None

    def rotary(self) -> Rotary:
        dtype = self.fc.weight.dtype
        if self._rotary is None or self._rotary.dtype != dtype or self._rotary.device != self.fc.weight.device:
            self._rotary = Rotary.default(self.cfg.head_dim, self.cfg.rope_theta, dtype=dtype,
                                          device=self.fc.weight.device)
        return self._rotary

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, head_dim]."""
        cos, sin = self.rotary().tables(positions)
        return cos[:, None], sin[:, None]

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Fused target features: taps [B, T, n_taps * d] -> [B, T, d]."""
        return rms_norm(self.fc(taps.to(self.fc.weight.dtype)), self.hidden_norm, self.cfg.rms_eps)

    def block_inputs(self, anchors: torch.Tensor, last_ctx: torch.Tensor | None = None) -> torch.Tensor:
        """anchors [B] (+ last context feature [B, d]) -> block input embeddings [B, block_size, d]."""
        B, g = anchors.shape[0], self.cfg.block_size
        dtype = self.fc.weight.dtype
        first = self.embed[anchors].to(dtype)[:, None]
        mask = self.mask_embedding if self.mask_embedding is not None else self.embed[self.cfg.mask_token_id].to(dtype)
        rest = mask.expand(B, g - 1, -1)
        x = torch.cat([first, rest], dim=1)
        if self.context_in is not None and last_ctx is not None:
            x = x + self.context_in(last_ctx.to(x.dtype))[:, None]
        return x

    def backbone(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor],
                 mask: torch.Tensor | None = None, packed_block: int = 0) -> torch.Tensor:
        """x [B, G, d] block inputs; ctx_k/v per layer [B, Hkv, C, D]. Returns final-normed h [B, G, d].
        ``packed_block``: x packs many blocks of that size (training; ``mask`` then covers the context only)."""
        for layer, ck, cv in zip(self.layers, ctx_k, ctx_v):
            x, _, _ = layer(x, cos, sin, ck, cv, mask, packed_block)
        return rms_norm(x, self.norm, self.cfg.rms_eps)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> fp32 logits [..., Vd] over the draft vocabulary through the frozen target head."""
        return self.head.logits(h)

    def markov_bias(self, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev_tokens [...] (global ids) -> (bias [..., Vd] fp32, markov embedding [..., r])."""
        e = self.markov_in(prev_tokens)
        return self.markov_out(e).float(), e

    def confidence_logit(self, h: torch.Tensor, markov_emb: torch.Tensor | None) -> torch.Tensor:
        """Raw confidence logit per slot: h [..., d] (+ markov embedding [..., r]) -> [...]."""
        inp = h if markov_emb is None else torch.cat([h, markov_emb.to(h.dtype)], dim=-1)
        return self.confidence(inp).squeeze(-1).float()


@dataclass
class _BlockState:
    cache: KVCache                     # per draft layer: rope'd context keys/values
    pending: list[torch.Tensor] = field(default_factory=list)  # taps [m, F] not yet in the cache
    n_ctx: int = 0                     # committed target positions already in the cache
    last_ctx: torch.Tensor | None = None  # fused feature of the last committed position [1, d]


class BlockProposer:
    """Runs a :class:`BlockDrafter` for one request stream (batch 1)."""

    def __init__(self, drafter: BlockDrafter, fingerprint: str | None = None):
        self.drafter = pack_linears(drafter.eval())     # prepacked weights on CPU; training unaffected
        self.cfg = drafter.cfg
        self.name = self.cfg.kind
        self.tap_layers = tuple(self.cfg.target_layer_ids)
        self.max_block = self.cfg.block_size
        self.fingerprint = fingerprint
        self._plan: BlockPlan | None = None

    def plan(self) -> BlockPlan:
        """The drafter's fused inference weights (:mod:`~dspark_core.drafters.block_plan`), rebuilt when
        its parameters change."""
        if self._plan is None or self._plan.key != weights_key(self._plan.params):
            self._plan = BlockPlan(self.drafter)
        return self._plan

    def start(self, prompt_ids: list[int], taps: torch.Tensor | None) -> _BlockState:
        c = self.cfg
        p = self.drafter.fc.weight
        cache = KVCache(c.num_layers, 1, c.num_kv_heads, c.head_dim, len(prompt_ids) + 256, p.dtype, p.device)
        return _BlockState(cache, [taps] if taps is not None else [], 0)

    def commit(self, state: _BlockState, tokens: list[int], taps: torch.Tensor | None) -> None:
        if taps is None or taps.shape[0] != len(tokens):
            raise ValueError(f"commit needs taps [{len(tokens)}, F], got {None if taps is None else tuple(taps.shape)}")
        state.pending.append(taps)

    @torch.inference_mode()
    def block_logits(self, state: _BlockState, anchor: int,
                     slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the backbone for the block after ``anchor`` -> (h [G, d], base logits [slots, vocab] fp32):
        the head runs only for the first ``slots`` (default all G) slots, the ones a round drafts."""
        self._absorb_many([state])
        d, n = self.drafter, state.n_ctx
        dev = d.fc.weight.device
        x = d.block_inputs(torch.tensor([anchor], device=dev), state.last_ctx)[0]
        h = self.plan().backbone(d, x, state.cache, n)
        return h, d.base_logits(h if slots is None else h[:slots])

    @torch.inference_mode()
    def propose(self, state: _BlockState, anchor: int, k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        k = min(k, self.max_block)
        if k <= 0:
            return Draft(torch.empty(0, dtype=torch.long))
        h, logits = self.block_logits(state, anchor, k)
        d = self.drafter
        head = d.head
        if d.markov_in is None:                       # DFlash: independent slots, vectorised
            return _independent_draft(head, logits[:k], params, generator)
        plan = self.plan()
        locals_, rows, embs = [], [], []
        emb = plan.markov_in[anchor]                  # the anchor: any target token
        for i in range(k):                            # the Markov loop: one r x Vd GEMV per slot
            local, probs = draw(logits[i] + plan.markov_out(emb).float(), params, generator)
            if probs is not None:
                rows.append(probs)
            embs.append(emb)
            locals_.append(local)
            emb = plan.markov_in_draft[local]         # a draft token: its row by draft-vocab id
        tokens = head.to_global(torch.stack(locals_))
        # the confidence head needs no draw: all k slots in one call after the loop
        conf = d.confidence_logit(h[:k], torch.stack(embs)) if d.confidence is not None else None
        return Draft(tokens.long().cpu(), head.to_global_probs(torch.stack(rows)) if rows else None, conf)


    @torch.inference_mode()
    def _absorb_many(self, states: list[_BlockState]) -> None:
        """Move the requests' pending target features into their context caches: fused features and
        each draft layer's rope'd keys and values. The requests' features are concatenated (every op on
        the way to the cached keys/values acts per position), so the fusion matmul and each layer's
        key/value projection run once for all of them, not once per request."""
        todo = [s for s in states if s.pending]
        if not todo:
            return
        d = self.drafter
        dev = d.fc.weight.device
        feats, spans, pos = [], [], []
        for st in todo:
            f = torch.cat(st.pending, dim=0) if len(st.pending) > 1 else st.pending[0]
            st.pending.clear()
            feats.append(f)
            spans.append(f.shape[0])
            pos.append(torch.arange(st.n_ctx, st.n_ctx + f.shape[0]))
        ctx, ks, vs = self.plan().absorb(d, torch.cat(feats, 0), torch.cat(pos).to(dev))   # [M, d], [M, Hkv, D]
        at = 0
        for st, m in zip(todo, spans):
            p0 = st.n_ctx
            st.cache.reserve(p0 + m)
            for li, (k, v) in enumerate(zip(ks, vs)):
                st.cache.k[li, 0, :, p0:p0 + m] = k[at:at + m].transpose(0, 1)
                st.cache.v[li, 0, :, p0:p0 + m] = v[at:at + m].transpose(0, 1)
            st.n_ctx = p0 + m
            st.cache.lengths[0] = st.n_ctx
            st.last_ctx = ctx[None, at + m - 1]
            at += m

    @torch.inference_mode()
    def propose_batch(self, states: list[_BlockState], anchors: list[int], ks: list[int],
                      params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[Draft]:
        """``propose`` for many requests in one backbone pass (contexts of different lengths, padded
        and masked). Each row draws only its own ``k`` slots with its own parameters and generator,
        in slot order, exactly as ``propose`` would, so a request's drafts never depend on which other
        requests share the call (up to the rounding of batched matmuls)."""
        ks = [min(k, self.max_block) for k in ks]
        out = [Draft(torch.empty(0, dtype=torch.long)) for _ in ks]
        live = [i for i, k in enumerate(ks) if k > 0]
        if not live:
            return out
        self._absorb_many([states[i] for i in live])
        d, c = self.drafter, self.cfg
        dev = d.fc.weight.device
        B, G = len(live), c.block_size
        ns = [states[i].n_ctx for i in live]
        n_max = max(ns)
        # each row's cached keys/values up to the longest context: one stack per layer (a row's keys
        # past its own length are stale or zero, and masked out)
        for i in live:
            states[i].cache.reserve(n_max)
        ctx_k = [torch.stack([states[i].cache.k[li, 0, :, :n_max] for i in live]) for li in range(c.num_layers)]
        ctx_v = [torch.stack([states[i].cache.v[li, 0, :, :n_max] for i in live]) for li in range(c.num_layers)]
        n_t = torch.tensor(ns, device=dev)
        ctx_ok = (torch.arange(n_max, device=dev)[None, None, :] < n_t[:, None, None]).expand(B, G, n_max)
        mask = torch.cat([ctx_ok, torch.ones(B, G, G, dtype=torch.bool, device=dev)], dim=-1)[:, None]  # [B, 1, G, n+G]
        rep = c.num_heads // c.num_kv_heads
        # folded for grouped-query attention and made additive once, not in each layer
        mask = additive_mask(mask.repeat(1, 1, rep, 1) if rep > 1 else mask, d.fc.weight.dtype)
        last = [states[i].last_ctx for i in live]
        last_ctx = torch.cat(last, 0) if all(t is not None for t in last) else None
        anchor_t = torch.tensor([anchors[i] for i in live], device=dev)
        x = d.block_inputs(anchor_t, last_ctx)
        h = self.plan().backbone_rows(d, x, n_t[:, None] + torch.arange(G, device=dev)[None], ctx_k, ctx_v, mask)
        k_top = max(ks[i] for i in live)
        logits = d.base_logits(h[:, :k_top])                                 # [B, k_top, Vd]: drafted slots only
        head = d.head
        if d.markov_in is None:                                              # DFlash: independent slots
            for b, i in enumerate(live):
                out[i] = _independent_draft(head, logits[b, :ks[i]], params[i], generators[i])
            return out
        k_live = [ks[i] for i in live]
        greedy = [params[i].greedy for i in live]
        tok_mat = torch.zeros(B, max(k_live), dtype=torch.long, device=dev)
        conf_mat = torch.zeros(B, max(k_live), device=dev) if d.confidence is not None else None
        rows: list[list[torch.Tensor]] = [[] for _ in live]
        prev = anchor_t.clone()
        for s in range(max(k_live)):                                        # the Markov loop, batched over rows
            sel = [b for b in range(B) if k_live[b] > s]
            every = len(sel) == B
            sel_t = None if every else torch.tensor(sel, device=dev)
            bias, emb = d.markov_bias(prev if every else prev[sel_t])
            z = (logits[:, s] if every else logits[sel_t, s]) + bias        # [len(sel), Vd]
            local = z.argmax(-1)
            for j, b in enumerate(sel):                                     # sampled rows: own params, generator
                if not greedy[b]:
                    i = live[b]
                    local[j], probs = draw(z[j], params[i], generators[i])
                    rows[b].append(probs)
            tok = head.to_global(local)
            if every:
                prev = tok
                tok_mat[:, s] = tok
            else:
                prev[sel_t] = tok
                tok_mat[sel_t, s] = tok
            if conf_mat is not None:
                conf = d.confidence_logit(h[:, s] if every else h[sel_t, s], emb)
                if every:
                    conf_mat[:, s] = conf
                else:
                    conf_mat[sel_t, s] = conf
        tok_cpu = tok_mat.cpu()
        for b, i in enumerate(live):
            k = k_live[b]
            out[i] = Draft(tok_cpu[b, :k].clone(),
                           head.to_global_probs(torch.stack(rows[b])) if rows[b] else None,
                           conf_mat[b, :k].clone() if conf_mat is not None else None)
        return out


def _independent_draft(head: DraftHead, logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None) -> Draft:
    """DFlash slots are independent: draw all k at once from logits [k, Vd]."""
    if params.greedy:
        return Draft(head.to_global(logits.argmax(-1)).cpu(), None, None)
    probs = token_probs(logits, params)
    return Draft(head.to_global(sample(probs, generator)).cpu(), head.to_global_probs(probs), None)


def block_train_forward(drafter: BlockDrafter, taps: torch.Tensor, tokens: torch.Tensor,
                        anchors: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced training pass over many blocks per sequence (DeepSpec's packed layout).

    taps [B, S, F] target features; tokens [B, S]; anchors [B, A] anchor positions; keep [B, A] bool
    (False = padding block). Block (b, a) sees the context strictly before its anchor and its own
    slots (bidirectional); the Markov head gets the true previous tokens. Returns draft logits
    [B, A, G, Vd] (fp32, bf16 under autocast) and confidence logits [B, A, G] (or None).
    """
    c = drafter.cfg
    B, S, _ = taps.shape
    A, G = anchors.shape[1], c.block_size
    dev = taps.device
    ctx = drafter.context(taps)                                                  # [B, S, d]
    cos_c, sin_c = drafter.rope(torch.arange(S, device=dev)[None])
    slot = torch.arange(G, device=dev)
    pos = (anchors[:, :, None] + slot).reshape(B, A * G)                         # [B, A*G]
    cos_b, sin_b = drafter.rope(pos)
    # context mask [B, 1, A*G, S]; each block also sees its own slots (packed_block_attention)
    block_anchor = anchors.repeat_interleave(G, dim=1)                           # [B, A*G]
    ctx_ok = torch.arange(S, device=dev)[None, None, :] < block_anchor[:, :, None]
    mask = (ctx_ok & keep.repeat_interleave(G, dim=1)[:, :, None])[:, None]
    ks, vs = [], []
    for layer in drafter.layers:
        k, v = layer.project_kv(ctx, cos_c, sin_c, normed=not c.context_norm)
        ks.append(k)
        vs.append(v)
    first = tokens.gather(1, anchors)                                            # [B, A]
    last_ctx = None
    if drafter.context_in is not None:                                          # feature at anchor - 1
        prev = (anchors - 1).clamp(min=0)
        last_ctx = ctx.gather(1, prev[:, :, None].expand(-1, -1, ctx.shape[-1])).reshape(B * A, -1)
    x = drafter.block_inputs(first.reshape(-1), last_ctx).reshape(B, A * G, -1)
    h = drafter.backbone(x, cos_b, sin_b, ks, vs, mask, packed_block=G)          # [B, A*G, d]
    logits = drafter.base_logits(h).view(B, A, G, -1)
    conf = None
    if drafter.markov_in is not None:
        prev_pos = (anchors[:, :, None] + slot).clamp(max=S - 1)                 # [B, A, G]: anchor, y1..
        prev = tokens.gather(1, prev_pos.view(B, -1)).view(B, A, G)
        emb = drafter.markov_in(prev)                                            # [B, A, G, r]
        # the Markov bias accumulated into the base logits by one addmm in the matmul's dtype: no fp32
        # [B, A, G, Vd] bias and no full-size sum
        logits = torch.addmm(logits.view(B * A * G, -1), emb.view(B * A * G, -1).to(logits.dtype),
                             drafter.markov_out.weight.to(logits.dtype).T).view(B, A, G, -1)
        if drafter.confidence is not None:
            conf = drafter.confidence_logit(h.view(B, A, G, -1), emb)
    elif drafter.confidence is not None:
        conf = drafter.confidence_logit(h.view(B, A, G, -1), None)
    return logits, conf
