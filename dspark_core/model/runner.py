"""Target runner: a lean, batched, KV-cached forward of a Llama/Qwen2/Qwen3-family decoder.

The runner owns no request state. Callers own a :class:`KVCache` and pass it in; ``forward`` appends
the given tokens after each row's committed length, and ``KVCache.truncate`` rolls rejected tokens
back in O(1). Hidden-state taps (raw residual stream after chosen decoder layers, -1 = embeddings)
are returned for the drafters. The slow reference is the Hugging Face model the weights came from;
tests hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark_core.model.layers import (KVCache, Linear, Rotary, additive_mask, apply_rope, attention, keep_attention_off_cudnn,
                     rms_norm)

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


@dataclass
class ForwardOutput:
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


class TargetRunner:
    """Batched KV-cached forward with hidden-state taps, fp32 or bf16, CPU or CUDA."""

    def __init__(self, arch: TargetArch, state_dict: dict[str, torch.Tensor], rotary: Rotary,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        keep_attention_off_cudnn(self.device)         # per-shape plans cost 40+ ms at each new key length
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
    @torch.inference_mode()
    def forward(self, cache: KVCache, input_ids: torch.Tensor, taps: tuple[int, ...] = (),
                logits: str = "all", rows: list[int] | None = None,
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
        return self._forward(cache, input_ids, taps, logits, rows, want_last_hidden, lengths, packed, fp32_logits)

    def _forward(self, cache, input_ids, taps, logits, rows, want_last_hidden, lengths=None,
                 packed=False, fp32_logits=True) -> ForwardOutput:
        a = self.arch
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, T], got shape {tuple(input_ids.shape)}")
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
        dev = self.device
        input_ids = input_ids.to(dev)

        offs = torch.arange(T, device=dev)
        start_t = torch.tensor(starts, device=dev)
        positions = start_t[:, None] + offs[None, :]                       # [B, T]

        single = B == 1
        all_rows = rows == list(range(cache.batch))
        causal = single and T > 1 and starts[0] == 0          # a fresh prefill: SDPA's causal kernel
        if (single and T == 1) or causal:
            mask = None
        else:
            key_pos = torch.arange(end, device=dev)
            mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
            if a.num_heads > a.num_kv_heads:        # folded for grouped-query attention once, not per layer
                mask = mask.repeat(1, 1, a.num_heads // a.num_kv_heads, 1)
            mask = additive_mask(mask, self.dtype)
        row_idx = None if single else torch.tensor(rows, device=dev)
        # The tokens the layers compute, token-major: all B * T, or with ``lengths`` only the real ones
        # (``real``: their indices in the padded [B * T] layout, which attention still uses).
        real = None
        tok_pos = positions.reshape(-1)
        if lengths is not None:               # index lists built on the host: no device sync on CUDA
            real = torch.tensor([b * T + t for b, n in enumerate(lengths) for t in range(n)], device=dev)
            tok_pos = tok_pos[real]
        N = tok_pos.shape[0]
        # Attention split for packed steps where at most a quarter of the rows carry drafts: every row's
        # first token (its anchor) attends in one [B, 1] call, the other tokens of the drafting rows in a
        # second call over those rows only (their keys gathered), so rows without drafts are not padded
        # to the longest row (16 rows, one verifying 4 drafts: 49.4 ms padded, 41.3 split, plain 42;
        # with more drafting rows the gather costs what the padding saved).
        split = None
        if real is not None:
            long_b = [b for b, n in enumerate(lengths) if n > 1]
            if 4 * len(long_b) <= B:
                starts_packed = [sum(lengths[:b]) for b in range(B)]        # packed index of each anchor
                first = torch.tensor(starts_packed, device=dev)
                lb = torch.tensor(long_b, device=dev)
                # the drafting rows' other tokens: slots in their padded [M, T - 1] layout, and packed indices
                real2 = torch.tensor([j * (T - 1) + t for j, b in enumerate(long_b) for t in range(lengths[b] - 1)],
                                     device=dev)
                src2 = torch.tensor([starts_packed[b] + 1 + t for b in long_b for t in range(lengths[b] - 1)],
                                    device=dev)
                key_pos = torch.arange(end, device=dev)
                rep = a.num_heads // a.num_kv_heads
                mask1 = additive_mask((key_pos[None, None, None, :]
                                       <= start_t[:, None, None, None]).repeat(1, 1, rep, 1), self.dtype)
                mask2 = additive_mask((key_pos[None, None, None, :]
                                       <= positions[lb, 1:][:, None, :, None]).repeat(1, 1, rep, 1), self.dtype)
                split = (first, real2, src2, mask1, mask2, row_idx[lb], len(long_b))
        cos, sin = self.rotary.tables(tok_pos)
        cos, sin = cos[:, None], sin[:, None]                               # [N, 1, D]
        H, Hkv, D, d, eps = a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size, a.rms_eps
        write_idx = None
        if not single:
            # Batched cache writes go through one flat index_copy_ per layer and tensor: slot (row, head,
            # position) of the [slots * Hkv * capacity, D] view. scatter_ along the position axis took
            # 2.4 ms per 30 layers for 4 rows and 9.4 ms for 16 on the 2-core CPU (this: 0.1-0.3 ms).
            tok_row = row_idx.repeat_interleave(T) if real is None else row_idx.repeat_interleave(T)[real]
            heads = torch.arange(Hkv, device=dev)
            write_idx = ((tok_row[:, None] * Hkv + heads[None, :]) * cache.capacity
                         + tok_pos[:, None]).reshape(-1)                      # [N * Hkv], token-major

        # The residual stream is kept 2-D so that each residual add can fuse into its matmul (addmm).
        flat_ids = input_ids.reshape(-1) if real is None else input_ids.reshape(-1)[real]
        x = F.embedding(flat_ids, self.embed)                               # [N, d]
        tap_set = {t: i for i, t in enumerate(taps)}
        tapped: list[torch.Tensor | None] = [None] * len(taps)
        if -1 in tap_set:
            tapped[tap_set[-1]] = x
        for li, L in enumerate(self.layers):
            h = F.rms_norm(x, (d,), L.ln1, eps)
            qkv = L.qkv(h).view(N, H + 2 * Hkv, D)
            qk = qkv[:, :H + Hkv]                                             # q and k heads together
            if L.qk_norm is not None:
                qk = F.rms_norm(qk, (D,), None, eps) * L.qk_norm
            qk = apply_rope(qk, cos, sin)                                     # one rope for q and k
            if real is None:
                q = qk[:, :H].view(B, T, H, D).transpose(1, 2)                # [B, H, T, D]
            elif split is None:
                q = qk.new_zeros(B * T, H, D).index_copy_(0, real, qk[:, :H]).view(B, T, H, D).transpose(1, 2)
            kc, vc = cache.k[li], cache.v[li]
            if single:
                r, s0 = rows[0], starts[0]
                kc[r, :, s0:s0 + T] = qk[:, H:].transpose(0, 1)
                vc[r, :, s0:s0 + T] = qkv[:, H + Hkv:].transpose(0, 1)
                kk, vv = kc[r:r + 1, :, :end], vc[r:r + 1, :, :end]
            else:
                kc.view(-1, D).index_copy_(0, write_idx, qk[:, H:].reshape(-1, D))
                vc.view(-1, D).index_copy_(0, write_idx, qkv[:, H + Hkv:].reshape(-1, D))
                if all_rows:
                    kk, vv = kc[:, :, :end], vc[:, :, :end]
                else:                                                         # only the rows' used keys
                    kk, vv = kc[row_idx, :, :end], vc[row_idx, :, :end]
            if split is None:
                att = attention(q, kk, vv, mask, causal).transpose(1, 2).reshape(B * T, H * D)  # [B * T, H * D]
                att = att if real is None else att[real]
            else:
                first, real2, src2, mask1, mask2, rows2, M = split
                q1 = qk[first, :H].view(B, 1, H, D).transpose(1, 2)
                q2 = qk.new_zeros(M * (T - 1), H, D).index_copy_(0, real2, qk[src2, :H])
                q2 = q2.view(M, T - 1, H, D).transpose(1, 2)
                att = qk.new_empty(N, H * D)
                att.index_copy_(0, first, attention(q1, kk, vv, mask1).transpose(1, 2).reshape(B, H * D))
                att2 = attention(q2, kc[rows2, :, :end], vc[rows2, :, :end], mask2)
                att.index_copy_(0, src2, att2.transpose(1, 2).reshape(M * (T - 1), H * D)[real2])
            x = L.o.add_to(x, att)
            h = F.rms_norm(x, (d,), L.ln2, eps)
            gate, up = L.gate_up(h).chunk(2, dim=-1)
            x = L.down.add_to(x, F.silu(gate) * up)
            if li in tap_set:
                tapped[tap_set[li]] = x
        for b, r in enumerate(rows):
            cache.lengths[r] += T if lengths is None else lengths[b]

        def padded(t: torch.Tensor) -> torch.Tensor:                     # [N, F] -> [B, T, F]
            if real is None:
                return t.view(B, T, -1)
            return t.new_empty(B * T, t.shape[-1]).index_copy_(0, real, t).view(B, T, -1)

        offsets = None
        if packed and real is not None and logits in ("all", "none") and not want_last_hidden:
            offsets = [0]
            for n in lengths[:-1]:
                offsets.append(offsets[-1] + n)
            padded = lambda t: t                                                  # noqa: E731
        taps_out = padded(torch.cat(tapped, dim=-1)) if taps else None
        need_norm = logits != "none" or want_last_hidden
        if logits == "last" and not want_last_hidden:                    # only each row's last real token
            if lengths is None:
                last = x[-1:] if B == 1 else x[torch.arange(B, device=dev) * T + T - 1]
            else:
                last = x[torch.tensor(lengths, device=dev).cumsum(0) - 1]
            hn = rms_norm(last, self.final_norm, eps)
            out_logits = self.head(hn)[:, None]              # [B, 1, V]
            out_logits = out_logits.float() if fp32_logits else out_logits
            return ForwardOutput(out_logits, taps_out, None)
        hn = rms_norm(x, self.final_norm, eps) if need_norm else None
        out_logits = None
        if logits == "all":
            out_logits = self.head(hn)
            out_logits = padded(out_logits.float() if fp32_logits else out_logits)
        elif logits == "last":
            ends = (torch.tensor(lengths, device=dev) - 1 if lengths is not None
                    else torch.full((B,), T - 1, device=dev))
            out_logits = self.head(padded(hn)[torch.arange(B, device=dev), ends][:, None])
            out_logits = out_logits.float() if fp32_logits else out_logits
        elif logits != "none":
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        hn = padded(hn) if want_last_hidden else None
        return ForwardOutput(out_logits, taps_out, hn, offsets)
