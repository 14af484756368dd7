"""Drafters: the DSpark/DFlash block drafter, the Eagle3-style drafter, n-gram and prompt lookup, their
factory and checkpoints. Each implements :class:`dspark_core.engine.proposer.Proposer`, the protocol the
decode loops consume."""

from dspark_core.drafters.block import BlockDrafter, BlockProposer
from dspark_core.drafters.checkpoint import (CHECKPOINT_FORMAT, DrafterMismatchError, build_drafter, load_drafter,
                                             read_checkpoint_meta, save_drafter)
from dspark_core.drafters.eagle3 import Eagle3Drafter, Eagle3Proposer
from dspark_core.drafters.factory import PROPOSER_KINDS, build_proposer
from dspark_core.drafters.lookup import LookupFirstProposer
from dspark_core.drafters.modules import DRAFTER_KINDS, DrafterConfig, drafter_config
from dspark_core.drafters.ngram import NgramProposer

__all__ = ["BlockDrafter", "BlockProposer", "CHECKPOINT_FORMAT", "DRAFTER_KINDS", "DrafterConfig",
           "DrafterMismatchError", "Eagle3Drafter", "Eagle3Proposer", "LookupFirstProposer", "NgramProposer",
           "PROPOSER_KINDS", "build_drafter", "build_proposer", "drafter_config", "load_drafter",
           "read_checkpoint_meta", "save_drafter"]
