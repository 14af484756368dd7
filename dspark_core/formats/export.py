"""Write a dspark drafter checkpoint as a folder the engines load as is.

``speculators``: vllm-project/speculators' ``DSparkDraftModel`` / ``DFlashDraftModel`` folder (``vllm serve
DIR`` and ``SpeculatorModel.from_pretrained(DIR)`` read it; the verifier is named by its local path).
``deepspec``: DeepSpec's ``Qwen3DSparkModel`` folder (vLLM's ``method: "dspark"`` reads it; it carries the
embedding and LM head it drafts with). Only a drafter in the reference layout (what
:func:`~dspark_core.drafters.modules.drafter_config` builds: q/k norms, ``context_norm`` off, a
``mask_token_id``) maps exactly; anything else is refused with the field that differs, never written
approximately.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark_core.drafters.block import BlockDrafter
from dspark_core.drafters.checkpoint import load_drafter, read_checkpoint_meta
from dspark_core.drafters.modules import DrafterConfig
from dspark_core.formats.common import (FORMATS, PROVENANCE_KEY, SPECULATORS_VERSION, FormatError, to_format_ids,
                                        vocab_maps, weight_names)
from dspark_core.model.target import MANIFEST, Target

# markov_in, markov_out and the confidence head are the DSpark heads; the rest is the DFlash backbone
_DSPARK_ONLY = ("markov_in.weight", "markov_out.weight", "confidence.weight", "confidence.bias")


def check_exportable(cfg: DrafterConfig, fmt: str) -> None:
    """Raise :class:`FormatError` naming every field that keeps ``cfg`` from mapping exactly to ``fmt``."""
    if fmt not in FORMATS:
        raise FormatError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if cfg.kind == "eagle3":
        raise FormatError("eagle3-style drafters have no counterpart in these formats; export a dspark or dflash "
                          "drafter")
    problems = []
    if not cfg.qk_norm:
        problems.append("qk_norm is off (the formats' draft layers always have q/k norms)")
    if cfg.context_norm:
        problems.append("context_norm is on (the formats key the context straight from hidden_norm)")
    if cfg.mask_token_id < 0:
        problems.append("the mask slots use a learned vector (the formats use a frozen embedding row, "
                        "mask_token_id)")
    if cfg.context_input:
        problems.append("context_input is on (a dspark-only input path)")
    if cfg.kind == "dspark" and (cfg.markov_rank <= 0 or not cfg.confidence_head):
        problems.append("a dspark drafter needs both its Markov head and its confidence head")
    if cfg.kind == "dflash" and fmt == "deepspec":
        problems.append("DeepSpec's format holds DSpark drafters; export a dflash drafter with --format speculators")
    if problems:
        raise FormatError(f"this {cfg.kind} drafter is not in the reference layout the {fmt} format needs: "
                          + "; ".join(problems) + ". Retrain it with the current defaults (dspark train), "
                          "which use the reference layout")


def _layer_config(cfg: DrafterConfig, target: Target) -> dict:
    """The Qwen3 decoder config both formats describe the draft layers with."""
    hf = target.hf_config
    return {
        "model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": int(getattr(hf, "max_position_embeddings", 32768)),
        "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * cfg.num_layers,
        "bos_token_id": getattr(hf, "bos_token_id", None), "eos_token_id": getattr(hf, "eos_token_id", None),
        "pad_token_id": getattr(hf, "pad_token_id", None),
    }


def _weights(model: BlockDrafter, saved: dict[str, torch.Tensor], fmt: str,
             target: Target) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The format's state dict from the checkpoint's ``saved`` weights (as stored: fp32, whatever dtype the
    target runs in), and the draft vocabulary's target ids in export order (None for the full vocabulary).
    The draft vocabulary is written in ascending target-id order, the order speculators and vLLM rebuild
    the head in from ``t2d``; the head rows and ``markov_w2`` follow that order."""
    cfg = model.cfg
    state = {k: v.float().contiguous() for k, v in saved.items()}
    names = weight_names(cfg.num_layers)
    out, used = {}, set()
    for ours, theirs in names.items():
        if ours in state:
            out[theirs] = state[ours]
            used.add(ours)
    head = model.head
    lm_head = target.runner.lm_head.detach().float().cpu()
    ids = None
    if head.trimmed:
        vocab = head.vocab_ids.cpu()
        order = torch.argsort(vocab)
        ids = vocab[order]
        out["lm_head.weight"] = lm_head[ids].contiguous()
        if "markov_head.markov_w2.weight" in out:
            out["markov_head.markov_w2.weight"] = out["markov_head.markov_w2.weight"][order].contiguous()
        d2t, t2d = vocab_maps(ids, cfg.vocab_size)
        out["d2t"], out["t2d"] = d2t, t2d
        used.add("head.vocab_ids")
    elif fmt == "deepspec":
        out["lm_head.weight"] = lm_head.contiguous()
    if fmt == "deepspec":
        out["embed_tokens.weight"] = target.runner.embed.detach().float().cpu().contiguous()
    left = sorted(set(state) - used)
    if left:   # a weight with no place in the format: never drop it silently
        raise FormatError(f"weights with no counterpart in the {fmt} format: {', '.join(left)}")
    return out, ids


def verifier_path(target: Target) -> str:
    """Where the target's own Hugging Face folder is (a registered local checkpoint keeps its weights where
    they were; the packaged SmolLM2 is dequantised into its prepared folder)."""
    if target.path is None:
        raise FormatError("the target has no folder on disk; give the verifier's name or path (--verifier)")
    folder = Path(target.path)
    manifest = folder / MANIFEST
    if not (folder / "config.json").exists() and manifest.exists():
        folder = Path(json.loads(manifest.read_text()).get("weights", folder))
    return str(folder.resolve())


def _speculators_config(cfg: DrafterConfig, target: Target, ids: torch.Tensor | None, provenance: dict,
                        verifier: str) -> dict:
    algo = cfg.kind
    return {
        "architectures": ["DSparkSpeculator" if algo == "dspark" else "DFlashSpeculator"],
        "speculators_model_type": algo, "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": algo,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": list(getattr(target.hf_config, "architectures", None) or [])},
        },
        "transformer_layer_config": _layer_config(cfg, target),
        "draft_vocab_size": int(ids.numel()) if ids is not None else cfg.vocab_size,
        "block_size": cfg.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": to_format_ids("speculators", cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id, "sliding_window_non_causal": False,
        # slot k (at anchor + k) predicts the token at anchor + k + 1, the anchor slot included
        "sample_from_anchor": True,
        **({"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True} if algo == "dspark" else {}),
        "dtype": "float32",
        PROVENANCE_KEY: provenance,
    }


def _deepspec_config(cfg: DrafterConfig, target: Target, ids: torch.Tensor | None, provenance: dict,
                     num_anchors: int) -> dict:
    out = _layer_config(cfg, target)
    out.update({
        "architectures": ["Qwen3DSparkModel"], "num_target_layers": target.arch.num_layers,
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": to_format_ids("deepspec", cfg.target_layer_ids), "num_anchors": num_anchors,
        "enable_confidence_head": True, "confidence_head_with_markov": True, "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla", "sample_from_anchor": True, "torch_dtype": "float32",
        PROVENANCE_KEY: provenance,
    })
    if ids is not None:
        out["draft_vocab_size"] = int(ids.numel())
    return out


def export_drafter(checkpoint: Path, target: Target, fmt: str, out: Path, num_anchors: int = 512,
                   verifier: str | None = None) -> Path:
    """Write the drafter checkpoint ``checkpoint`` (trained for ``target``) to ``out`` in format ``fmt``:
    ``config.json`` with the format's field names and ``model.safetensors`` with its weight names.

    ``verifier`` is how the serving engine will find the target (a hub id or a path on the serving hosts;
    default: the target's folder here). The drafter's weights are written as the checkpoint stores them;
    the head and embedding rows come from ``target``'s runner, exact when it runs in float32. ``num_anchors`` is DeepSpec's training-time field (blocks per
    sequence); it does not change drafting."""
    checkpoint, out = Path(checkpoint), Path(out)
    meta = read_checkpoint_meta(checkpoint)
    cfg = DrafterConfig.from_dict(meta["config"])
    check_exportable(cfg, fmt)
    verifier = verifier or verifier_path(target)
    model = load_drafter(checkpoint, target.runner, target.fingerprint)     # checks the target and the weights
    weights, ids = _weights(model, load_file(str(checkpoint / "model.safetensors")), fmt, target)
    provenance = {"target_fingerprint": target.fingerprint, "kind": cfg.kind, "source": str(checkpoint),
                  "target_layer_ids": list(cfg.target_layer_ids), "format": fmt}
    config = (_speculators_config(cfg, target, ids, provenance, verifier) if fmt == "speculators"
              else _deepspec_config(cfg, target, ids, provenance, num_anchors))
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
