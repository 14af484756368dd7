"""Proposers behind one interface, their factory, and drafter checkpoints (safetensors + JSON)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..runner import TargetRunner
from .base import Draft, Proposer
from .block import BlockDrafter, BlockProposer
from .eagle3 import Eagle3Drafter, Eagle3Proposer
from .modules import DRAFTER_KINDS, DrafterConfig, drafter_config
from .lookup import LookupFirstProposer
from .ngram import NgramProposer

PROPOSER_KINDS = ("none", "ngram") + DRAFTER_KINDS + ("dspark-lookup",)   # dspark-lookup: prompt lookup first
CHECKPOINT_FORMAT = "dspark-drafter/1"

__all__ = ["Draft", "Proposer", "BlockDrafter", "BlockProposer", "Eagle3Drafter", "Eagle3Proposer",
           "NgramProposer", "LookupFirstProposer", "DrafterConfig", "drafter_config", "build_drafter", "build_proposer",
           "save_drafter", "load_drafter", "DrafterMismatchError", "PROPOSER_KINDS"]


class DrafterMismatchError(ValueError):
    """A drafter checkpoint does not belong to the target it is being loaded for."""


def build_drafter(cfg: DrafterConfig, runner: TargetRunner, seed: int = 0) -> BlockDrafter | Eagle3Drafter:
    """A freshly initialised drafter (seeded; the global RNG state is restored afterwards)."""
    cls = Eagle3Drafter if cfg.kind == "eagle3" else BlockDrafter
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg, runner.embed, runner.lm_head)
    return model.to(device=runner.device, dtype=runner.dtype)


def save_drafter(model: BlockDrafter | Eagle3Drafter, folder: Path, target_fingerprint: str,
                 extra: dict | None = None) -> Path:
    """Write ``model.safetensors`` (trainable weights only) and ``config.json`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    meta = {"format": CHECKPOINT_FORMAT, "config": model.cfg.to_dict(), "target_fingerprint": target_fingerprint,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(meta, indent=2))
    return folder


def read_checkpoint_meta(folder: Path) -> dict:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists() or not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"{folder} is not a drafter checkpoint (needs config.json and model.safetensors)")
    meta = json.loads(cfg_path.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{cfg_path}: unknown checkpoint format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}")
    return meta


def load_drafter(folder: Path, runner: TargetRunner, target_fingerprint: str) -> BlockDrafter | Eagle3Drafter:
    """Load a drafter checkpoint for this target; refuses a checkpoint made for another target."""
    meta = read_checkpoint_meta(folder)
    if meta["target_fingerprint"] != target_fingerprint:
        raise DrafterMismatchError(
            f"drafter {folder} was trained for target {meta['target_fingerprint'][:12]}, but the loaded target "
            f"is {target_fingerprint[:12]}; train a drafter for this target (dspark train) or load the matching target")
    cfg = DrafterConfig.from_dict(meta["config"])
    a = runner.arch
    if (cfg.hidden_size, cfg.vocab_size) != (a.hidden_size, a.vocab_size):
        raise DrafterMismatchError(f"drafter {folder} has width/vocab {cfg.hidden_size}/{cfg.vocab_size}, "
                                   f"target has {a.hidden_size}/{a.vocab_size}")
    model = build_drafter(cfg, runner)
    model.load_state_dict({k: v for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}, strict=True)
    return model.to(device=runner.device, dtype=runner.dtype)


def build_proposer(kind: str, runner: TargetRunner, target_fingerprint: str, checkpoint: Path | None = None,
                   block_size: int | None = None, seed: int = 0, preset: str = "default") -> Proposer | None:
    """The proposer named ``kind`` ("none" gives None: plain target decoding)."""
    if kind not in PROPOSER_KINDS:
        raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(PROPOSER_KINDS)}")
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramProposer(block_size or 7)
    if kind == "dspark-lookup":
        return LookupFirstProposer(build_proposer("dspark", runner, target_fingerprint, checkpoint, block_size,
                                                  seed, preset))
    if checkpoint is not None:
        model = load_drafter(checkpoint, runner, target_fingerprint)
        if model.cfg.kind != kind:
            raise DrafterMismatchError(f"checkpoint {checkpoint} holds a {model.cfg.kind} drafter, not {kind}")
    else:
        overrides = {"block_size": block_size} if block_size else {}
        model = build_drafter(drafter_config(kind, runner.arch, preset, **overrides), runner, seed)
    runner.validate_taps(tuple(model.cfg.target_layer_ids))
    if kind == "eagle3":
        proposer = Eagle3Proposer(model, target_fingerprint)
        proposer.max_block = block_size or model.cfg.block_size   # autoregressive: any horizon runs
        return proposer
    if block_size and block_size > model.cfg.block_size:
        raise ValueError(f"block size {block_size} exceeds the drafter's trained block size {model.cfg.block_size}; "
                         f"a block drafter can verify fewer tokens than it was trained for, not more")
    proposer = BlockProposer(model, target_fingerprint)
    proposer.max_block = block_size or model.cfg.block_size
    return proposer
