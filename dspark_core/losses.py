"""Drafter training losses (DSpark paper Eqs. 9-12, DeepSpec defaults): CE + L1 (= 2 TV) + confidence BCE.

Everything is a weighted mean over supervised slots with position weights w_i = exp(-i / decay)
(slot i 0-based; decay 4.0 as in every released config).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossConfig:
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9
    alpha_conf: float = 1.0
    decay: float = 4.0

    @classmethod
    def preset(cls, kind: str) -> "LossConfig":
        """DSpark: 0.1 CE + 0.9 L1 + 1.0 confidence; DFlash and Eagle3 baselines: CE only (DeepSpec configs)."""
        if kind == "dspark":
            return cls()
        if kind in ("dflash", "eagle3"):
            return cls(alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0)
        raise ValueError(f"no loss preset for {kind!r}")


def position_weights(valid: torch.Tensor, decay: float) -> torch.Tensor:
    """valid [N, G] bool (a contiguous supervised prefix per block) -> weights [N, G] fp32."""
    g = valid.shape[-1]
    w = torch.exp(-torch.arange(g, dtype=torch.float32, device=valid.device) / decay)
    return w * valid.float()


def acceptance_probability(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """sum_v min(draft, target) = 1 - TV: the chance speculative sampling accepts a draw from draft."""
    return torch.minimum(draft_probs, target_probs).sum(-1)


def drafter_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                 valid: torch.Tensor, cfg: LossConfig, confidence_logits: torch.Tensor | None = None,
                 vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted training loss and diagnostics.

    draft_logits [N, G, Vd] (Vd = full vocab, or the trimmed draft vocab listed in ``vocab_ids`` [Vd]);
    target_logits [N, G, V] full vocab (no grad); labels [N, G] full-vocab token ids; valid [N, G] bool;
    confidence_logits [N, G] or None. Returns (loss, metrics of python floats).
    """
    if draft_logits.shape[:2] != labels.shape or labels.shape != valid.shape:
        raise ValueError(f"draft_logits [N, G, V] {tuple(draft_logits.shape)}, labels {tuple(labels.shape)} and "
                         f"valid {tuple(valid.shape)} must agree on [N, G]")
    w = position_weights(valid, cfg.decay)
    wsum = w.sum().clamp_min(1e-8)
    target_probs = target_logits.float().softmax(-1).detach()                        # [N, G, V]
    draft_logp = draft_logits.float().log_softmax(-1)                                # [N, G, Vd]
    draft_probs = draft_logp.exp()
    if vocab_ids is not None:
        # labels outside the draft vocabulary cannot be drafted: their CE term is skipped
        remap = torch.full((target_logits.shape[-1],), -1, dtype=torch.long, device=labels.device)
        remap[vocab_ids] = torch.arange(vocab_ids.shape[0], device=labels.device)
        local = remap[labels]
        in_vocab = local >= 0
        ce = -draft_logp.gather(-1, local.clamp_min(0)[..., None]).squeeze(-1) * in_vocab
        target_in = target_probs[..., vocab_ids]
        l1 = (draft_probs - target_in).abs().sum(-1) + (1.0 - target_in.sum(-1)).clamp_min(0)
        accept = torch.minimum(draft_probs, target_in).sum(-1)
    else:
        ce = -draft_logp.gather(-1, labels[..., None]).squeeze(-1)
        l1 = (draft_probs - target_probs).abs().sum(-1)
        accept = torch.minimum(draft_probs, target_probs).sum(-1)
    loss_ce = (w * ce).sum() / wsum
    loss_tv = (w * l1).sum() / wsum
    loss = cfg.alpha_ce * loss_ce + cfg.alpha_tv * loss_tv
    metrics = {"loss_ce": float(loss_ce.detach()), "loss_tv": float(loss_tv.detach())}
    soft_label = accept.detach().clamp(0.0, 1.0)                                      # c* = 1 - TV
    if confidence_logits is not None and cfg.alpha_conf > 0:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), soft_label, reduction="none")
        loss_conf = (w * bce).sum() / wsum
        loss = loss + cfg.alpha_conf * loss_conf
        metrics["loss_conf"] = float(loss_conf.detach())
        conf = torch.sigmoid(confidence_logits.float().detach())
        metrics["conf_abs_err"] = float((w * (conf - soft_label).abs()).sum() / wsum)
    # teacher-forced expected acceptance length: 1 + sum_k prod_{i<=k} c*_i over the supervised prefix
    surv = torch.cumprod(torch.where(valid, soft_label, torch.zeros_like(soft_label)), dim=-1)
    metrics["tau_expected"] = float(1.0 + surv.sum(-1).mean())
    vf = valid.float()
    metrics["accept_per_pos"] = ((soft_label * vf).sum(0) / vf.sum(0).clamp_min(1)).tolist()
    metrics["loss"] = float(loss.detach())
    return loss, metrics
