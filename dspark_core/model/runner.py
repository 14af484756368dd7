"""Target runner: a lean, batched, KV-cached forward of a Llama/Qwen2/Qwen3-family decoder.

The runner owns no request state. Callers own a :class:`KVCache` and pass it in; ``forward`` appends
the given tokens after each row's committed length, and ``KVCache.truncate`` rolls rejected tokens
back in O(1). Hidden-state taps (raw residual stream after chosen decoder layers, -1 = embeddings)
are returned for the drafters. The slow reference is the Hugging Face model the weights came from;
tests hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from dspark_core.model.layers import (KVCache, Linear, Rotary, additive_mask, apply_rope, attention,
                                     keep_attention_off_cudnn, rms_norm)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class TargetArch:
    """The architecture facts the runner and the drafters need (plain data, no HF objects)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, cfg) -> "TargetArch":
        model_type = getattr(cfg, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported target architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            rms_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            qkv_bias=bool(getattr(cfg, "attention_bias", model_type == "qwen2")) or model_type == "qwen2",
        )


def select_taps(all_taps: torch.Tensor, have: tuple[int, ...], want: tuple[int, ...], hidden: int) -> torch.Tensor:
    """Columns of the layers ``want`` from taps [..., len(have) * hidden] captured for layers ``have``."""
    if tuple(want) == tuple(have):
        return all_taps
    missing = [t for t in want if t not in have]
    if missing:
        raise ValueError(f"taps of layers {tuple(have)} lack layers {missing}")
    cols = torch.cat([torch.arange(have.index(t) * hidden, (have.index(t) + 1) * hidden) for t in want])
    return all_taps[..., cols.to(all_taps.device)]


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: Linear              # [(H + 2 Hkv) * D, d] (+ bias for Qwen2)
    qk_norm: torch.Tensor | None   # [H + Hkv, D]: q_norm rows then k_norm rows (Qwen3)
    o: Linear                # [d, H * D]
    ln2: torch.Tensor
    gate_up: Linear          # [2 * I, d]
    down: Linear             # [d, I]


LogitRows = Literal["all", "last", "none"]      # which positions' logits a forward returns


@dataclass
class ForwardOutput:
    """What :meth:`TargetRunner.forward` returns (which fields are set follows its :class:`Readout`)."""

    logits: torch.Tensor | None        # [batch, rows, vocab] fp32 (rows = T, or 1 with logits="last")
    taps: torch.Tensor | None          # [batch, T, n_taps * hidden] in the runner dtype
    last_hidden: torch.Tensor | None   # [batch, T, hidden] post final norm (training only)
    # ``packed`` forwards: logits and taps are [N, ...] over the real tokens only, row b's first at
    # offsets[b] (no [batch, T, ...] padded copy of a [N, vocab] fp32 tensor per step)
    offsets: list[int] | None = None

    def row(self, t: torch.Tensor, b: int, n: int) -> torch.Tensor:
        """Row b's first n positions of ``t`` (this output's logits or taps), packed or padded."""
        if self.offsets is not None:
            return t[self.offsets[b]:self.offsets[b] + n]
        return t[b, :n]


@dataclass(frozen=True)
class Readout:
    """What a forward returns: the caller's choice (see :meth:`TargetRunner.forward`)."""

    taps: tuple[int, ...] = ()          # layers whose residual stream is returned (-1: the embeddings)
    logits: LogitRows = "all"
    want_last_hidden: bool = False      # the final-normed hidden states too (training features)
    packed: bool = False                # ragged outputs as [N, ...] over the real tokens (logits "all"/"none")
    fp32_logits: bool = True            # False: logits stay in the runner dtype


@dataclass(frozen=True)
class SplitAttention:
    """Attention in two calls for a packed step where at most a quarter of the rows carry drafts.

    Every row's first token (its anchor) attends in one [B, 1] call; the other tokens of the M drafting
    rows attend in a second call over those rows only (their keys gathered), so rows without drafts are
    not padded to the longest row. With more drafting rows the gather costs what the padding saves.
    """

    anchors: torch.Tensor        # [B] packed index of each row's anchor
    draft_slots: torch.Tensor    # [n] the drafting rows' other tokens: slots in their padded [M * (T - 1)] layout
    draft_src: torch.Tensor      # [n] the same tokens' packed indices
    anchor_mask: torch.Tensor    # [B, 1, rep, S] additive
    draft_mask: torch.Tensor     # [M, 1, rep * (T - 1), S] additive
    draft_rows: torch.Tensor     # [M] the drafting rows' cache rows


@dataclass(frozen=True)
class ForwardPlan:
    """One forward worked out on the host before the first layer runs: which cache rows and positions its
    tokens take, which of the padded [B, T] tokens are computed (N of them, token-major), how attention
    is masked, where keys and values are written, and what comes back. Every layer reads it as is.

    ``rep`` below is the grouped-query fold (query heads per KV head) and S = ``end`` the keys attended.
    """

    # the batch
    rows: tuple[int, ...]               # [B] the cache row of each input row
    steps: int                          # T: tokens per row of the padded input
    starts: tuple[int, ...]             # [B] each row's committed length before this forward
    lengths: tuple[int, ...] | None     # [B] real tokens per row (ragged, padded on the right); None: all T
    end: int                            # S: keys at positions [0, end) are attended
    # the computed tokens
    real: torch.Tensor | None           # [N] their indices in the padded [B * T] layout; None: all B * T
    cos: torch.Tensor                   # [N, 1, D] rotary tables at each token's position
    sin: torch.Tensor                   # [N, 1, D] (sign-folded, see Rotary)
    # cache writes and key reads
    write_slots: torch.Tensor | None    # [N * Hkv] flat (row, head, position) slots; None: one row, a slice
    key_rows: torch.Tensor | None       # [B] rows whose keys are gathered; None: the one row, or all rows
    # attention
    mask: torch.Tensor | None           # [B, 1, rep * T, S] additive; None: one token, or a causal prefill
    causal: bool                        # a fresh one-row prefill: SDPA's causal kernel, no mask
    split: SplitAttention | None        # two attention calls instead of one (see SplitAttention)
    # what comes back
    readout: Readout
    offsets: list[int] | None           # packed outputs: row b's first token at offsets[b]; None: [B, T, ...]

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def one_row(self) -> bool:
        """One row with every token real: its keys and values are written and read as slices."""
        return self.write_slots is None


def causal_mask(positions: torch.Tensor, end: int, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, rep * T, end] letting a query at positions[b, t] see keys at positions <= it.

    Folded for grouped-query attention (``rep`` query heads per KV head) once per forward, not per layer.
    """
    key_pos = torch.arange(end, device=positions.device)
    mask = key_pos[None, None, None, :] <= positions[:, None, :, None]      # [B, 1, T, S]
    if rep > 1:
        mask = mask.repeat(1, 1, rep, 1)
    return additive_mask(mask, dtype)


class TargetRunner:
    """Batched KV-cached forward with hidden-state taps, fp32 or bf16, CPU or CUDA."""

    def __init__(self, arch: TargetArch, state_dict: dict[str, torch.Tensor], rotary: Rotary,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        keep_attention_off_cudnn(self.device)         # cuDNN would plan anew at each new key length
        self.rotary = rotary.to(dtype, self.device)

        def w(name: str) -> torch.Tensor:
            return state_dict[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")  # [vocab, d]
        self.lm_head = self.embed if arch.tie_word_embeddings or "lm_head.weight" not in state_dict \
            else w("lm_head.weight")
        self.final_norm = w("model.norm.weight")
        self.head = Linear(self.lm_head)             # logits; ``lm_head`` stays raw (drafters share its rows)
        self.layers: list[_Layer] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                             w(p + "self_attn.v_proj.weight")], 0).contiguous()
            bias = None
            if (p + "self_attn.q_proj.bias") in state_dict:
                bias = torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                  w(p + "self_attn.v_proj.bias")], 0).contiguous()
            self.layers.append(_Layer(
                ln1=w(p + "input_layernorm.weight"),
                qkv=Linear(qkv, bias),
                qk_norm=torch.cat([w(p + "self_attn.q_norm.weight").expand(arch.num_heads, -1),
                                   w(p + "self_attn.k_norm.weight").expand(arch.num_kv_heads, -1)], 0)
                if arch.qk_norm else None,
                o=Linear(w(p + "self_attn.o_proj.weight")),
                ln2=w(p + "post_attention_layernorm.weight"),
                gate_up=Linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], 0)
                               .contiguous()),
                down=Linear(w(p + "mlp.down_proj.weight")),
            ))

    # ------------------------------------------------------------------ cache
    def new_cache(self, batch: int = 1, capacity: int = 256) -> KVCache:
        a = self.arch
        return KVCache(a.num_layers, batch, a.num_kv_heads, a.head_dim, capacity, self.dtype, self.device)

    def validate_taps(self, taps: tuple[int, ...]) -> None:
        last = self.arch.num_layers - 1
        if any(t < -1 or t >= last for t in taps) or list(taps) != sorted(set(taps)):
            raise ValueError(f"tap layers must be strictly increasing ids in [-1, {last - 1}] "
                             f"(the final layer is excluded), got {list(taps)}")

    # ---------------------------------------------------------------- forward
    # Nine keyword options: the one public entry for every caller (prefill, decode, verify, batched and
    # packed steps, training features); they become a Readout and a ForwardPlan at once.
    @torch.inference_mode()
    def forward(self, cache: KVCache, input_ids: torch.Tensor, taps: tuple[int, ...] = (),
                logits: LogitRows = "all", rows: list[int] | None = None,
                want_last_hidden: bool = False, lengths: list[int] | None = None,
                packed: bool = False, fp32_logits: bool = True) -> ForwardOutput:
        """Append ``input_ids`` ([batch, T]) after each row's committed length and run the decoder.

        ``rows`` selects which cache rows the batch maps to (default: all rows, in order). Each row's
        length grows by T; callers truncate afterwards to what they keep. ``logits``: "all", "last" or
        "none". ``lengths`` (1 <= lengths[b] <= T): row b holds only its first lengths[b] tokens (ragged
        verify lengths, padded on the right); the padding is never computed (the rows are packed for
        every matmul, so a step costs its real tokens, not batch x longest row), never written to the
        cache, and row b grows by lengths[b]. Outputs past a row's length are then unspecified.
        ``packed`` (with ``logits`` "all" or "none"): with ragged ``lengths``, logits and taps come back
        [N, ...] over the real tokens, read with :meth:`ForwardOutput.row`. ``fp32_logits=False`` leaves
        the logits in the runner dtype (greedy callers: argmax of the exact fp32 upcast is the same index,
        and a step skips writing [N, vocab] fp32).
        """
        readout = Readout(tuple(taps), logits, want_last_hidden, packed, fp32_logits)
        plan = self._plan(cache, input_ids, rows, lengths, readout)
        x = self._embed(plan, input_ids)                                    # [N, d]
        tapped = {-1: x} if -1 in readout.taps else {}
        for li, layer in enumerate(self.layers):
            x = self._decoder_layer(plan, layer, cache.k[li], cache.v[li], x)
            if li in readout.taps:
                tapped[li] = x
        for b, r in enumerate(plan.rows):                                   # commit: each row grows
            cache.lengths[r] += plan.steps if plan.lengths is None else plan.lengths[b]
        return self._outputs(plan, x, tapped)

    # 1. plan: validate the call, grow the cache, work out positions, packing, masks and write slots
    def _plan(self, cache: KVCache, input_ids: torch.Tensor, rows: list[int] | None,
              lengths: list[int] | None, readout: Readout) -> ForwardPlan:
        a, dev = self.arch, self.device
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, T], got shape {tuple(input_ids.shape)}")
        if readout.logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {readout.logits!r}")
        B, T = input_ids.shape
        rows = list(range(cache.batch)) if rows is None else rows
        if len(rows) != B:
            raise ValueError(f"input batch {B} does not match {len(rows)} cache rows")
        if lengths is not None:
            if len(lengths) != B or any(not 1 <= n <= T for n in lengths):
                raise ValueError(f"lengths must give 1..{T} tokens for each of the {B} rows, got {list(lengths)}")
            if sum(lengths) == B * T:
                lengths = None
        starts = [cache.lengths[r] for r in rows]
        end = max(starts) + T
        cache.reserve(end)
        start_t = torch.tensor(starts, device=dev)
        positions = start_t[:, None] + torch.arange(T, device=dev)[None, :]   # [B, T]
        tok_pos = positions.reshape(-1)                                     # [N]
        real = None
        if lengths is not None:               # index lists built on the host: no device sync on CUDA
            real = torch.tensor([b * T + t for b, n in enumerate(lengths) for t in range(n)], device=dev)
            tok_pos = tok_pos[real]
        cos, sin = self.rotary.tables(tok_pos)
        one_row = B == 1 and lengths is None
        causal = one_row and T > 1 and starts[0] == 0
        rep = a.num_heads // a.num_kv_heads
        mask = None if one_row and (T == 1 or causal) else causal_mask(positions, end, rep, self.dtype)
        row_idx = None if one_row else torch.tensor(rows, device=dev)
        write_slots = key_rows = split = None
        if not one_row:
            # Batched cache writes go through one flat index_copy_ per layer and tensor: slot (row, head,
            # position) of the [slots * Hkv * capacity, D] view; a scatter_ along the position axis costs
            # several times more on CPU.
            tok_row = row_idx.repeat_interleave(T) if real is None else row_idx.repeat_interleave(T)[real]
            heads = torch.arange(a.num_kv_heads, device=dev)
            write_slots = ((tok_row[:, None] * a.num_kv_heads + heads[None, :]) * cache.capacity
                           + tok_pos[:, None]).reshape(-1)                    # [N * Hkv], token-major
            key_rows = None if rows == list(range(cache.batch)) else row_idx
            if lengths is not None:
                split = self._split_attention(lengths, positions, row_idx, end)
        offsets = None
        if readout.packed and lengths is not None and readout.logits != "last" and not readout.want_last_hidden:
            offsets = [0]
            for n in lengths[:-1]:
                offsets.append(offsets[-1] + n)
        return ForwardPlan(rows=tuple(rows), steps=T, starts=tuple(starts),
                           lengths=None if lengths is None else tuple(lengths), end=end, real=real,
                           cos=cos[:, None], sin=sin[:, None], write_slots=write_slots, key_rows=key_rows,
                           mask=mask, causal=causal, split=split, readout=readout, offsets=offsets)

    def _split_attention(self, lengths: list[int], positions: torch.Tensor, row_idx: torch.Tensor,
                         end: int) -> SplitAttention | None:
        """The two-call attention layout for a packed step, where at most a quarter of the rows draft."""
        B, T = positions.shape
        long_b = [b for b, n in enumerate(lengths) if n > 1]
        if not long_b or 4 * len(long_b) > B:
            return None
        dev = self.device
        anchors = [sum(lengths[:b]) for b in range(B)]                      # packed index of each anchor
        lb = torch.tensor(long_b, device=dev)
        rep = self.arch.num_heads // self.arch.num_kv_heads
        return SplitAttention(
            anchors=torch.tensor(anchors, device=dev),
            draft_slots=torch.tensor([j * (T - 1) + t for j, b in enumerate(long_b) for t in range(lengths[b] - 1)],
                                     device=dev),
            draft_src=torch.tensor([anchors[b] + 1 + t for b in long_b for t in range(lengths[b] - 1)], device=dev),
            anchor_mask=causal_mask(positions[:, :1], end, rep, self.dtype),
            draft_mask=causal_mask(positions[lb, 1:], end, rep, self.dtype),
            draft_rows=row_idx[lb])

    # 2. embed the computed tokens, token-major
    def _embed(self, plan: ForwardPlan, input_ids: torch.Tensor) -> torch.Tensor:
        flat_ids = input_ids.to(self.device).reshape(-1)
        return F.embedding(flat_ids if plan.real is None else flat_ids[plan.real], self.embed)   # [N, d]

    # 3. one decoder layer; the residual stream stays 2-D so each residual add fuses into its matmul (addmm)
    def _decoder_layer(self, plan: ForwardPlan, L: _Layer, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
        a = self.arch
        H, Hkv, D, d, eps = a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size, a.rms_eps
        h = F.rms_norm(x, (d,), L.ln1, eps)
        qkv = L.qkv(h).view(x.shape[0], H + 2 * Hkv, D)                    # [N, H + 2 Hkv, D]
        qk = qkv[:, :H + Hkv]                                               # q and k heads together
        if L.qk_norm is not None:
            qk = F.rms_norm(qk, (D,), None, eps) * L.qk_norm
        qk = apply_rope(qk, plan.cos, plan.sin)                             # one rope for q and k
        keys, values = self._write_kv(plan, k_cache, v_cache, qk[:, H:], qkv[:, H + Hkv:])
        att = self._attend(plan, qk[:, :H], keys, values, k_cache, v_cache)  # [N, H * D]
        x = L.o.add_to(x, att)                                              # x + o(att)
        h = F.rms_norm(x, (d,), L.ln2, eps)
        gate, up = L.gate_up(h).chunk(2, dim=-1)
        return L.down.add_to(x, F.silu(gate) * up)                          # x + down(silu(gate) * up)

    def _write_kv(self, plan: ForwardPlan, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the tokens' keys and values ([N, Hkv, D]) into this layer's cache ([rows, Hkv, capacity, D]);
        return the keys and values attended, [B, Hkv, S, D]."""
        end = plan.end
        if plan.one_row:
            r, s0, T = plan.rows[0], plan.starts[0], plan.steps
            k_cache[r, :, s0:s0 + T] = k.transpose(0, 1)
            v_cache[r, :, s0:s0 + T] = v.transpose(0, 1)
            return k_cache[r:r + 1, :, :end], v_cache[r:r + 1, :, :end]
        D = k.shape[-1]
        k_cache.view(-1, D).index_copy_(0, plan.write_slots, k.reshape(-1, D))
        v_cache.view(-1, D).index_copy_(0, plan.write_slots, v.reshape(-1, D))
        if plan.key_rows is None:
            return k_cache[:, :, :end], v_cache[:, :, :end]
        return k_cache[plan.key_rows, :, :end], v_cache[plan.key_rows, :, :end]   # only the rows' used keys

    def _attend(self, plan: ForwardPlan, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of the computed tokens' queries q [N, H, D] -> [N, H * D]."""
        B, T = plan.batch, plan.steps
        N, H, D = q.shape
        if plan.split is not None:
            return self._attend_split(plan, q, keys, values, k_cache, v_cache)
        if plan.real is None:
            qb = q.view(B, T, H, D)
        else:                                                               # padded to [B, T] for SDPA
            qb = q.new_zeros(B * T, H, D).index_copy_(0, plan.real, q).view(B, T, H, D)
        att = attention(qb.transpose(1, 2), keys, values, plan.mask, plan.causal)    # [B, H, T, D]
        att = att.transpose(1, 2).reshape(B * T, H * D)
        return att if plan.real is None else att[plan.real]

    def _attend_split(self, plan: ForwardPlan, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """:meth:`_attend` as the two calls of :class:`SplitAttention`."""
        s, B, T, end = plan.split, plan.batch, plan.steps, plan.end
        N, H, D = q.shape
        M = s.draft_rows.shape[0]
        q1 = q[s.anchors].view(B, 1, H, D).transpose(1, 2)                  # [B, H, 1, D]
        q2 = q.new_zeros(M * (T - 1), H, D).index_copy_(0, s.draft_slots, q[s.draft_src])
        q2 = q2.view(M, T - 1, H, D).transpose(1, 2)                        # [M, H, T - 1, D]
        att = q.new_empty(N, H * D)
        att.index_copy_(0, s.anchors, attention(q1, keys, values, s.anchor_mask).transpose(1, 2).reshape(B, H * D))
        att2 = attention(q2, k_cache[s.draft_rows, :, :end], v_cache[s.draft_rows, :, :end], s.draft_mask)
        att.index_copy_(0, s.draft_src, att2.transpose(1, 2).reshape(M * (T - 1), H * D)[s.draft_slots])
        return att

    # 4. read out taps, logits and hidden states
    def _outputs(self, plan: ForwardPlan, x: torch.Tensor, tapped: dict[int, torch.Tensor]) -> ForwardOutput:
        want, dev, B, T = plan.readout, self.device, plan.batch, plan.steps
        eps = self.arch.rms_eps
        unpad = (lambda t: t) if plan.offsets is not None else (lambda t: self._unpad(plan, t))
        taps_out = unpad(torch.cat([tapped[t] for t in want.taps], dim=-1)) if want.taps else None
        if want.logits == "last" and not want.want_last_hidden:            # only each row's last real token
            if plan.lengths is None:
                last = x[-1:] if B == 1 else x[torch.arange(B, device=dev) * T + T - 1]
            else:
                last = x[torch.tensor(plan.lengths, device=dev).cumsum(0) - 1]
            out_logits = self.head(rms_norm(last, self.final_norm, eps))[:, None]    # [B, 1, V]
            return ForwardOutput(self._logit_dtype(plan, out_logits), taps_out, None)
        need_norm = want.logits != "none" or want.want_last_hidden
        hn = rms_norm(x, self.final_norm, eps) if need_norm else None       # [N, d]
        out_logits = None
        if want.logits == "all":
            out_logits = unpad(self._logit_dtype(plan, self.head(hn)))
        elif want.logits == "last":
            ends = (torch.tensor(plan.lengths, device=dev) - 1 if plan.lengths is not None
                    else torch.full((B,), T - 1, device=dev))
            out_logits = self._logit_dtype(plan, self.head(unpad(hn)[torch.arange(B, device=dev), ends][:, None]))
        return ForwardOutput(out_logits, taps_out, unpad(hn) if want.want_last_hidden else None, plan.offsets)

    @staticmethod
    def _logit_dtype(plan: ForwardPlan, logits: torch.Tensor) -> torch.Tensor:
        return logits.float() if plan.readout.fp32_logits else logits

    @staticmethod
    def _unpad(plan: ForwardPlan, t: torch.Tensor) -> torch.Tensor:
        """[N, F] -> [B, T, F]; positions past a row's length are left uninitialised."""
        B, T = plan.batch, plan.steps
        if plan.real is None:
            return t.view(B, T, -1)
        return t.new_empty(B * T, t.shape[-1]).index_copy_(0, plan.real, t).view(B, T, -1)
