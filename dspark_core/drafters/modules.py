"""Drafter configuration and the transformer layer shared by the DSpark/DFlash and Eagle3 drafters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from dspark_core.model.layers import Linear, apply_rope, attention, packed_block_attention, rms_norm
from dspark_core.model.runner import TargetArch

DRAFTER_KINDS = ("dspark", "dflash", "eagle3")


@dataclass(frozen=True)
class DrafterConfig:
    """Everything needed to rebuild a drafter; saved as JSON next to its weights."""

    kind: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    target_layer_ids: tuple[int, ...]
    num_layers: int = 2
    block_size: int = 7
    markov_rank: int = 0          # 0 = no Markov head (DFlash, Eagle3)
    confidence_head: bool = False
    qk_norm: bool = False
    draft_vocab_size: int = 0     # 0 = full target vocab; else the most frequent target tokens only
    context_input: bool = False   # block drafters: also add the last context feature to every slot input
    # block drafters: the reference layout (DeepSpec's Qwen3DSparkModel, speculators' DSparkDraftModel) keys
    # the context features as they come out of hidden_norm and fills the mask slots with the frozen target
    # embedding row of ``mask_token_id``; the older layout (these defaults, what a checkpoint without the
    # fields was trained with) ran the context through each layer's input norm and learned a mask vector
    context_norm: bool = True
    mask_token_id: int = -1       # -1: a learned mask embedding

    def __post_init__(self):
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not -1 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be -1 (learned) or a token id below {self.vocab_size}, "
                             f"got {self.mask_token_id}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        d = dict(d)
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        return cls(**d)


def default_tap_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """Evenly spaced raw-layer taps from layer 1 to about L-3 (never the final layer)."""
    hi = max(0, num_layers - 3) if num_layers >= 4 else num_layers - 2
    lo = min(1, hi)
    if hi < 0:
        return (-1,)
    n = min(count, hi - lo + 1)
    if n <= 1:
        return (hi,)
    return tuple(sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)}))


PRESETS = {
    # name: (draft layers, markov rank) for dspark; dflash drops the Markov head; eagle3 uses 1 layer.
    "default": (2, 64),
    "tiny": (1, 8),
}


def default_mask_token(arch: TargetArch) -> int:
    """The token whose frozen embedding row fills a block's mask slots: the last row of the target's
    embedding table (an unused padding row on Qwen-family targets, a rare merge on others). Any fixed
    row works, since the drafter learns around it; it is recorded in the drafter's config."""
    return arch.vocab_size - 1


def drafter_config(kind: str, arch: TargetArch, preset: str = "default", **overrides) -> DrafterConfig:
    """A drafter config derived from the target (width, heads, vocab, rope) and a named preset. Block
    drafters get the reference layout (q/k norms whatever the target family, context keyed straight from
    hidden_norm, the mask slots a frozen embedding row), so they export to the engines' formats as is."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    layers, rank = PRESETS[preset]
    taps = default_tap_layers(arch.num_layers, 3 if kind == "eagle3" else 5)
    cfg = DrafterConfig(
        kind=kind, hidden_size=arch.hidden_size, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, intermediate_size=arch.intermediate_size, vocab_size=arch.vocab_size,
        rms_eps=arch.rms_eps, rope_theta=arch.rope_theta, target_layer_ids=taps,
        num_layers=1 if kind == "eagle3" else layers,
        markov_rank=rank if kind == "dspark" else 0,
        confidence_head=kind == "dspark", qk_norm=arch.qk_norm or kind != "eagle3",
    )
    if kind != "eagle3":
        cfg = replace(cfg, context_norm=False, mask_token_id=default_mask_token(arch))
    return replace(cfg, **overrides)


class DraftLayer(nn.Module):
    """Pre-norm decoder layer whose attention can take extra (context) keys/values."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, H, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.ln1 = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, H * D, bias=False)
        self.k_proj = nn.Linear(d, Hkv * D, bias=False)
        self.v_proj = nn.Linear(d, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, d, bias=False)
        self.q_norm = nn.Parameter(torch.ones(D)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(D)) if cfg.qk_norm else None
        self.ln2 = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, n, self.cfg.head_dim).transpose(1, 2)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, normed: bool = False):
        """Keys/values of x [B, T, d] at the positions of cos/sin [B, 1, T, D] -> two [B, Hkv, T, D]; ``normed``:
        x goes to the projections as is (already normed, or the reference layout's context features)."""
        h = x if normed else rms_norm(x, self.ln1, self.cfg.rms_eps)
        k = self._heads(self.k_proj(h), self.cfg.num_kv_heads)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, self.cfg.rms_eps)
        return apply_rope(k, cos, sin), self._heads(self.v_proj(h), self.cfg.num_kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor | None, ctx_v: torch.Tensor | None,
                mask: torch.Tensor | None, packed_block: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d]; keys = [ctx_k ; own keys]. Returns (new x, own keys, own values).

        ``packed_block`` > 0 (training's packed layout): x holds T / packed_block blocks, each attending to
        the context ``mask`` [B, 1, T, C] allows and to its own slots (see ``packed_block_attention``)."""
        c = self.cfg
        h = rms_norm(x, self.ln1, c.rms_eps)
        q = self._heads(self.q_proj(h), c.num_heads)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, c.rms_eps)
        q = apply_rope(q, cos, sin)
        k, v = self.project_kv(h, cos, sin, normed=True)
        if packed_block:
            att = packed_block_attention(q, ctx_k, ctx_v, k, v, mask, packed_block)
        else:
            kk = k if ctx_k is None else torch.cat([ctx_k, k], dim=2)
            vv = v if ctx_v is None else torch.cat([ctx_v, v], dim=2)
            att = attention(q, kk, vv, mask)
        B, T, _ = x.shape
        x = x + self.o_proj(att.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim))
        h = rms_norm(x, self.ln2, c.rms_eps)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, k, v


class DraftHead(nn.Module):
    """The drafter's view of the frozen target LM head, optionally trimmed to a draft vocabulary.

    With a trimmed vocabulary the drafter can only propose tokens in ``vocab_ids``; its distribution
    puts zero mass elsewhere, which rejection sampling handles exactly (lossless), and the per-slot
    logit cost drops from V x d to Vd x d.
    """

    def __init__(self, cfg: DrafterConfig, lm_head: torch.Tensor):
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.size = cfg.draft_vocab_size or cfg.vocab_size
        self.trimmed = 0 < cfg.draft_vocab_size < cfg.vocab_size
        self.register_buffer("lm_head", lm_head, persistent=False)                # [V, d] frozen target head
        # persistent: saved with the checkpoint (all zeros until set_vocab is called)
        self.register_buffer("vocab_ids", torch.zeros(self.size, dtype=torch.long) if self.trimmed
                             else torch.arange(self.size), persistent=self.trimmed)
        self._rows: torch.Tensor | None = None
        self._packed: tuple[torch.Tensor, Linear] | None = None     # (rows it packs, packed head)

    def set_vocab(self, vocab_ids: torch.Tensor) -> None:
        if not self.trimmed or vocab_ids.shape != (self.size,):
            raise ValueError(f"draft vocab must be [{self.size}] ids for a trimmed head, got {tuple(vocab_ids.shape)}")
        self.vocab_ids.copy_(vocab_ids)
        self._rows = self._packed = None

    def rows(self, dtype: torch.dtype) -> torch.Tensor:
        """[Vd, d] head rows of the draft vocabulary (a cached slice when trimmed)."""
        if not self.trimmed:
            return self.lm_head.to(dtype)
        if self._rows is None or self._rows.dtype != dtype or self._rows.device != self.lm_head.device:
            self._rows = self.lm_head[self.vocab_ids].to(dtype)
        return self._rows

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> fp32 draft-vocab logits [..., Vd] (when no gradient is recorded, through the rows
        prepacked by :class:`~dspark_core.model.layers.Linear` on CPU). In training (a gradient recorded) they
        stay in the matmul's dtype (bf16 under autocast): the loss reads them in fp32 row chunks, and an
        fp32 copy of [anchors x slots, Vd] plus its gradient's cast back cost more than the matmul."""
        rows = self.rows(h.dtype)
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            return h @ rows.T
        if self._packed is None or self._packed[0] is not rows:
            self._packed = (rows, Linear(rows))
        return self._packed[1](h).float()

    def to_global(self, local_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_ids[local_ids] if self.trimmed else local_ids

    def to_global_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V] with zeros outside the draft vocabulary."""
        if not self.trimmed:
            return probs
        full = probs.new_zeros(probs.shape[:-1] + (self.vocab_size,))
        return full.index_copy_(-1, self.vocab_ids, probs)

    def _apply(self, fn, *args, **kwargs):
        self._rows = self._packed = None
        return super()._apply(fn, *args, **kwargs)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """HF-style initialisation: normal(0, std) for linear/embedding weights, zero biases."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
