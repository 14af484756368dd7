"""Read a speculators or DeepSpec DSpark/DFlash folder into a dspark drafter checkpoint.

The result is an ordinary dspark checkpoint for the prepared target (``dspark train --init`` fine-tunes
it, ``dspark eval`` and ``dspark serve`` load it). Every weight in the folder must land somewhere and
every weight of the drafter must come from the folder: a converter that drops or invents a weight is the
failure users of these formats report most (random weights served, acceptance near zero), so both are
errors here. The target is checked in that order: the fingerprint an export of ours recorded, else the
LM-head rows (and DeepSpec's embedding) the folder carries against the prepared target's, else shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from dspark_core.drafters.checkpoint import DrafterMismatchError, build_drafter, save_drafter
from dspark_core.drafters.modules import DrafterConfig
from dspark_core.formats.common import (PROVENANCE_KEY, FormatError, from_format_ids, target_ids_from_maps,
                                        weight_names)
from dspark_core.model.target import Target

# weights a folder may carry that a dspark drafter takes from the target instead (checked, not loaded)
_FROM_TARGET = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "d2t",
                "t2d"}


@dataclass(frozen=True)
class ImportReport:
    """What an import read and how it checked the target."""

    format: str
    kind: str
    checkpoint: str
    weights: int
    target_check: str      # "fingerprint", "head rows", "head and embedding rows" or "shapes only"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def detect_format(config: dict) -> str:
    """``speculators`` or ``deepspec`` from a folder's config.json, else :class:`FormatError`."""
    if config.get("speculators_model_type") in ("dspark", "dflash"):
        return "speculators"
    if "speculators_model_type" in config:
        raise FormatError(f"speculators model type {config['speculators_model_type']!r} is not a block drafter; "
                          "dspark imports dspark and dflash")
    if "Qwen3DSparkModel" in (config.get("architectures") or []):
        return "deepspec"
    raise FormatError("not a speculators DSpark/DFlash folder (no speculators_model_type) nor a DeepSpec "
                      "Qwen3DSparkModel folder (architectures)")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{folder} has no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            out[k[len("model."):] if k.startswith("model.") else k] = v
    return out


def _refuse_unsupported(fmt: str, kind: str, layer: dict, top: dict) -> None:
    problems = []
    if top.get("sample_from_anchor", True) is False:
        problems.append("sample_from_anchor is false (mask slots predicting their own position's token)")
    if int(top.get("markov_rank", 0) or 0) > 0 and top.get("markov_head_type", "vanilla") != "vanilla":
        problems.append(f"markov_head_type {top.get('markov_head_type')!r} (only vanilla is supported)")
    conf = bool(top.get("enable_confidence_head", False))
    rank = int(top.get("markov_rank", 0) or 0) if kind == "dspark" else 0
    if conf and rank > 0 and not top.get("confidence_head_with_markov", True):
        problems.append("confidence_head_with_markov is false")
    if kind == "dspark" and rank <= 0:
        problems.append("a DSpark drafter without its Markov head (markov_rank 0)")
    if layer.get("attention_bias"):
        problems.append("attention_bias in the draft layers")
    if layer.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {layer.get('hidden_act')!r}")
    if any(t != "full_attention" for t in layer.get("layer_types") or []):
        problems.append("sliding-window draft layers")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        problems.append(f"rope type {rope.get('rope_type', rope.get('type'))!r}")
    if int(top.get("mask_token_id", -1) if top.get("mask_token_id") is not None else -1) < 0:
        problems.append("no mask_token_id")
    if problems:
        raise FormatError(f"this {fmt} {kind} drafter uses what dspark does not implement: " + "; ".join(problems))


def _config(fmt: str, raw: dict, target: Target) -> tuple[DrafterConfig, int]:
    """The dspark config for a folder's config.json, and the folder's draft vocabulary size."""
    if fmt == "speculators":
        kind, layer, top = raw["speculators_model_type"], raw.get("transformer_layer_config") or {}, raw
        ids = raw.get("aux_hidden_state_layer_ids")
        draft_vocab = int(raw.get("draft_vocab_size") or layer.get("vocab_size"))
    else:
        kind, layer, top = "dspark", raw, raw
        ids = raw.get("target_layer_ids")
        draft_vocab = int(raw.get("draft_vocab_size") or raw.get("vocab_size"))
    _refuse_unsupported(fmt, kind, layer, top)
    if not ids:
        raise FormatError(f"the {fmt} config names no target layers")
    taps = from_format_ids(fmt, ids)
    a = target.arch
    if (layer.get("hidden_size"), layer.get("vocab_size")) != (a.hidden_size, a.vocab_size):
        raise DrafterMismatchError(
            f"the drafter is {layer.get('hidden_size')} wide over a {layer.get('vocab_size')}-token vocabulary; the "
            f"prepared target {target.name} is {a.hidden_size} wide over {a.vocab_size} tokens: it was made for "
            "another target")
    try:
        target.runner.validate_taps(taps)
    except ValueError as e:
        raise DrafterMismatchError(f"target layers {list(ids)} ({fmt} ids) do not fit target {target.name} "
                                   f"({a.num_layers} layers): {e}") from None
    rope = layer.get("rope_parameters") if isinstance(layer.get("rope_parameters"), dict) else {}
    heads = int(layer["num_attention_heads"])
    rank = int(top.get("markov_rank", 0) or 0) if kind == "dspark" else 0
    cfg = DrafterConfig(
        kind=kind, hidden_size=int(layer["hidden_size"]), num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
        intermediate_size=int(layer["intermediate_size"]), vocab_size=int(layer["vocab_size"]),
        rms_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))), target_layer_ids=taps,
        num_layers=int(layer["num_hidden_layers"]), block_size=int(top["block_size"]), markov_rank=rank,
        confidence_head=bool(top.get("enable_confidence_head", False)) and kind == "dspark", qk_norm=True,
        draft_vocab_size=0 if draft_vocab == int(layer["vocab_size"]) else draft_vocab,
        context_norm=False, mask_token_id=int(top["mask_token_id"]))
    return cfg, draft_vocab


def _rows_match(theirs: torch.Tensor, ours: torch.Tensor) -> bool:
    """Equal up to the rounding of a bf16 or fp16 save."""
    return theirs.shape == ours.shape and torch.allclose(theirs.float(), ours.float(), rtol=1e-2, atol=1e-3)


def import_drafter(folder: Path, target: Target, out: Path) -> ImportReport:
    """Convert the speculators or DeepSpec folder ``folder`` into a dspark checkpoint at ``out`` for
    ``target``; raises :class:`FormatError` or :class:`DrafterMismatchError` with the reason."""
    folder, out = Path(folder), Path(out)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FormatError(f"{folder} has no config.json")
    raw = json.loads(cfg_path.read_text())
    fmt = detect_format(raw)
    cfg, draft_vocab = _config(fmt, raw, target)
    weights = _read_weights(folder)
    runner = target.runner

    check = "shapes only"
    recorded = (raw.get(PROVENANCE_KEY) or {}).get("target_fingerprint")
    if recorded and recorded != target.fingerprint:
        raise DrafterMismatchError(f"{folder} was exported for target {recorded[:12]}, the prepared target "
                                   f"{target.name} is {target.fingerprint[:12]}")
    ids = None
    if draft_vocab != cfg.vocab_size:
        if "d2t" not in weights:
            raise FormatError(f"a {draft_vocab}-token draft vocabulary needs d2t in the weights")
        ids = target_ids_from_maps(weights["d2t"], weights.get("t2d"), cfg.vocab_size)
        if ids.numel() != draft_vocab:
            raise FormatError(f"d2t has {ids.numel()} entries, draft_vocab_size is {draft_vocab}")
    head_rows = runner.lm_head.detach().cpu()
    if "lm_head.weight" in weights:
        want = head_rows[ids] if ids is not None else head_rows
        if not _rows_match(weights["lm_head.weight"], want):
            raise DrafterMismatchError(
                f"the LM head in {folder} differs from target {target.name}'s head rows: the drafter was made "
                "for another target, or trains its own head (dspark drafters draft through the target's frozen "
                "head)")
        check = "head rows"
    if "embed_tokens.weight" in weights:
        if not _rows_match(weights["embed_tokens.weight"], runner.embed.detach().cpu()):
            raise DrafterMismatchError(f"the token embedding in {folder} differs from target {target.name}'s: "
                                       "the drafter was made for another target")
        check = "head and embedding rows" if check == "head rows" else "embedding rows"
    if recorded:
        check = "fingerprint"

    names = {theirs: ours for ours, theirs in weight_names(cfg.num_layers).items()}
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for k, v in weights.items():
        if k in names:
            state[names[k]] = v.float()
        elif k not in _FROM_TARGET and not k.endswith("rotary_emb.inv_freq"):
            unknown.append(k)
    if unknown:
        raise FormatError(f"weights dspark has no place for (a different architecture?): {', '.join(sorted(unknown))}")
    model = build_drafter(cfg, runner)
    if ids is not None:
        state["head.vocab_ids"] = ids
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise FormatError(f"{folder} lacks trained weights the drafter needs: {', '.join(missing)}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise FormatError(f"weights in {folder} do not fit the architecture its config describes: {e}") from None
    save_drafter(model, out, target.fingerprint,
                 extra={"imported_from": {"format": fmt, "path": str(folder), "target_check": check}})
    return ImportReport(format=fmt, kind=cfg.kind, checkpoint=str(out), weights=len(weights), target_check=check)
