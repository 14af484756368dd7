import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def dspark_home() -> Path:
    """The data home shared by real-model tests: $DSPARK_HOME or the repo's .dspark (prepared once)."""
    return Path(os.environ.get("DSPARK_HOME", REPO / ".dspark"))


@pytest.fixture(scope="session")
def smollm2(dspark_home):
    """The real SmolLM2-135M target in fp32, with its HF reference model (prepared on first use)."""
    from dspark_core.model.target import DEFAULT_TARGET, load_target, prepare_smollm2
    d = dspark_home / "targets" / DEFAULT_TARGET
    if not (d / "dspark_target.json").exists():
        prepare_smollm2(dspark_home)
    return load_target(d, dtype=torch.float32, keep_reference=True)
