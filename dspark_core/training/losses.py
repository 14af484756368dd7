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


class _SlotTerms(torch.autograd.Function):
    """Per-slot CE, L1 and acceptance from draft logits and target probabilities, in row chunks.

    The plain autograd graph of these three terms keeps about ten [N, Vd] fp32 temporaries per step
    (log-probabilities, probabilities, differences, signs, minima and their gradients): at 128 anchors
    x 7 slots x 4 sequences over an 8,192-token draft vocabulary each is 117 MB, and allocating,
    filling and freeing them dominates a CPU training step. Here forward and backward work
    through ``CHUNK`` rows at a time and the backward recomputes the softmax, so only the logits, the
    target and the logits' gradient are full size.

    With q = softmax(z), s = sign(q - p): d CE / dz = q - onehot(label); d L1 / dz = q * (s - <s, q>).
    """

    CHUNK = 256

    @staticmethod
    def forward(ctx, logits, target, local):
        dt = torch.promote_types(logits.dtype, torch.float32)          # fp32 (fp64 in gradcheck)
        ce = torch.empty(logits.shape[0], dtype=dt, device=logits.device)
        l1, accept = torch.empty_like(ce), torch.empty_like(ce)
        for i in range(0, logits.shape[0], _SlotTerms.CHUNK):
            sl = slice(i, i + _SlotTerms.CHUNK)
            logp = logits[sl].to(dt).log_softmax(-1)
            lab = local[sl]
            ce[sl] = -logp.gather(-1, lab.clamp_min(0)[:, None]).squeeze(-1) * (lab >= 0)
            q = logp.exp_()
            l1[sl] = (q - target[sl]).abs_().sum(-1)
            accept[sl] = torch.minimum(q, target[sl]).sum(-1)
        ctx.save_for_backward(logits, target, local)
        ctx.mark_non_differentiable(accept)
        return ce, l1, accept

    @staticmethod
    def backward(ctx, g_ce, g_l1, _g_accept):
        logits, target, local = ctx.saved_tensors
        grad = torch.empty_like(logits)
        dt = torch.promote_types(logits.dtype, torch.float32)
        for i in range(0, logits.shape[0], _SlotTerms.CHUNK):
            sl = slice(i, i + _SlotTerms.CHUNK)
            q = logits[sl].to(dt).softmax(-1)
            s = (q - target[sl]).sign_()
            gz = q * (s - (s * q).sum(-1, keepdim=True)) * g_l1[sl, None]     # L1 through the softmax
            lab = local[sl]
            gc = g_ce[sl] * (lab >= 0)
            gz.add_(q * gc[:, None])                                          # CE: q - onehot(label)
            gz.scatter_add_(-1, lab.clamp_min(0)[:, None], -gc[:, None])
            grad[sl] = gz
        return grad, None, None


def slot_terms(draft_logits: torch.Tensor, target_probs: torch.Tensor, local_labels: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """draft_logits [..., Vd]; target_probs [..., Vd]; local_labels [...] (index into Vd, -1 = none).
    Returns per-slot (CE, sum |q - p|, sum min(q, p)) [...] with q = softmax(draft_logits); the third
    carries no gradient."""
    lead, V = draft_logits.shape[:-1], draft_logits.shape[-1]
    dt = torch.promote_types(draft_logits.dtype, torch.float32)
    out = _SlotTerms.apply(draft_logits.reshape(-1, V), target_probs.reshape(-1, V).to(dt),
                           local_labels.reshape(-1))
    return tuple(t.view(lead) for t in out)


@dataclass(frozen=True)
class DraftVocab:
    """A trimmed draft vocabulary: ``ids`` [Vd], token ids out of the target's ``size``-token vocabulary."""

    ids: torch.Tensor
    size: int


def target_probs_from_logits(target_logits: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The target's full-vocabulary probabilities, [N, G, V] logits -> [N, G, Vd] over the draft vocabulary
    (``vocab_ids``; None = the full vocabulary). No gradient."""
    target_probs = target_logits.float().softmax(-1).detach()                        # [N, G, V]
    return target_probs if vocab_ids is None else target_probs[..., vocab_ids]       # [N, G, Vd]


def drafter_loss(draft_logits: torch.Tensor, target_probs: torch.Tensor, labels: torch.Tensor,
                 valid: torch.Tensor, cfg: LossConfig, confidence_logits: torch.Tensor | None = None,
                 vocab: DraftVocab | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted training loss and diagnostics.

    draft_logits [N, G, Vd] (Vd = full vocab, or the trimmed draft vocabulary ``vocab``); target_probs
    [N, G, Vd] the target's full-vocabulary probabilities restricted to the draft vocabulary (training
    computes them once per distinct position; :func:`target_probs_from_logits` from logits); labels
    [N, G] full-vocab token ids; valid [N, G] bool; confidence_logits [N, G] or None. Returns (loss,
    metrics of python floats).
    """
    if draft_logits.shape[:2] != labels.shape or labels.shape != valid.shape:
        raise ValueError(f"draft_logits [N, G, V] {tuple(draft_logits.shape)}, labels {tuple(labels.shape)} and "
                         f"valid {tuple(valid.shape)} must agree on [N, G]")
    if target_probs.shape != draft_logits.shape:
        raise ValueError(f"target_probs {tuple(target_probs.shape)} must match draft_logits "
                         f"{tuple(draft_logits.shape)} ([N, G, Vd])")
    w = position_weights(valid, cfg.decay)
    wsum = w.sum().clamp_min(1e-8)
    target_probs = target_probs.detach()
    if vocab is not None:
        # labels outside the draft vocabulary cannot be drafted: their CE term is skipped (local id -1)
        remap = torch.full((vocab.size,), -1, dtype=torch.long, device=labels.device)
        remap[vocab.ids] = torch.arange(vocab.ids.shape[0], device=labels.device)
        local = remap[labels]
    else:
        local = labels
    ce, l1, accept = slot_terms(draft_logits, target_probs, local)
    if vocab is not None:
        # the target's mass outside the draft vocabulary counts in full: the drafter puts none there
        l1 = l1 + (1.0 - target_probs.sum(-1)).clamp_min(0)
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
