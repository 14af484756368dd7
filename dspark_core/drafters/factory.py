"""Every proposer by name: ``build_proposer("dspark" | "dflash" | "eagle3" | "ngram" | ...)``."""

from __future__ import annotations

from pathlib import Path

from dspark_core.drafters.block import BlockProposer
from dspark_core.drafters.checkpoint import DrafterMismatchError, build_drafter, load_drafter
from dspark_core.drafters.eagle3 import Eagle3Proposer
from dspark_core.drafters.lookup import LookupFirstProposer
from dspark_core.drafters.modules import DRAFTER_KINDS, drafter_config
from dspark_core.drafters.ngram import NgramProposer
from dspark_core.engine.proposer import Proposer
from dspark_core.model.runner import TargetRunner

PROPOSER_KINDS = ("none", "ngram") + DRAFTER_KINDS + ("dspark-lookup",)   # dspark-lookup: prompt lookup first


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
