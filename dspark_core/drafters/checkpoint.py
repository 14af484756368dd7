"""Drafter checkpoints: ``model.safetensors`` (trainable weights) + ``config.json`` (config, target
fingerprint). A checkpoint only loads for the target whose fingerprint it carries."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark_core.drafters.block import BlockDrafter
from dspark_core.drafters.eagle3 import Eagle3Drafter
from dspark_core.drafters.modules import DrafterConfig
from dspark_core.model.runner import TargetRunner

CHECKPOINT_FORMAT = "dspark-drafter/1"


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
