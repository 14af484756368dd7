"""MLflow models-from-code file for a registered drafter (logged by :mod:`registry.mlflow_registry`).

MLflow loads this file as the model (``python_model=<path of this file>``), so it needs nothing but
mlflow and the standard library: no torch, no dspark_core, no pickle. The model holds no tensors.
A drafter runs against its frozen target, and the target is not part of the artifact. Loading the
pyfunc gives the local paths and parsed metadata of the drafter's artifacts. Turning the checkpoint
into a drafter for a loaded target is
:func:`registry.mlflow_registry.load_drafter_from_registry`'s job. It calls
``dspark_core.drafters.load_drafter``, which checks the target fingerprint.

Artifacts (``context.artifacts`` keys):

- ``checkpoint`` (required): a drafter checkpoint folder (``model.safetensors`` + ``config.json``).
- ``calibration`` (optional): ``Calibration.to_dict()`` as JSON.
- ``sps`` (optional): the SPS(B) profile written by ``dspark_core.scheduling.sps.save_sps``.

``predict(["config", "target_fingerprint", ...])`` returns one JSON string per requested key, in
order. Keys are listed in :data:`KEYS`; a missing optional artifact gives ``"null"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel

KEYS = ("config", "calibration", "sps", "checkpoint_path", "target_fingerprint")


def _read_json(path: str | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path else None


class DrafterModel(PythonModel):
    """Paths and parsed metadata of one registered drafter; ``predict`` answers lookups as JSON."""

    def load_context(self, context) -> None:
        arts = context.artifacts
        if "checkpoint" not in arts:
            raise ValueError("the drafter model has no 'checkpoint' artifact; it was not logged by the dspark registry")
        self.checkpoint_path = str(Path(arts["checkpoint"]).resolve())
        self.config = _read_json(str(Path(self.checkpoint_path) / "config.json"))
        self.calibration = _read_json(arts.get("calibration"))
        self.sps = _read_json(arts.get("sps"))

    def _value(self, key: str):
        if key == "checkpoint_path":
            return self.checkpoint_path
        if key == "target_fingerprint":
            return self.config.get("target_fingerprint")
        return getattr(self, key)

    # Type hints are required: without them MLflow turns a list input into a DataFrame.
    def predict(self, context, model_input: list[str], params: dict | None = None) -> list[str]:
        """One JSON string per requested key; an unknown key raises ``ValueError`` naming the valid ones."""
        unknown = [k for k in model_input if k not in KEYS]
        if unknown:
            raise ValueError(f"unknown drafter keys {unknown}; valid keys: {', '.join(KEYS)}")
        return [json.dumps(self._value(k)) for k in model_input]


mlflow.models.set_model(DrafterModel())
