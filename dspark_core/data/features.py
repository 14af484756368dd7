"""The frozen target's features of training sequences, captured while bootstrap generates them.

Training a drafter needs, for every training sequence, the target's hidden-state taps (the drafter's
context), its final hidden states and the log-normaliser of its next-token logits (the TV target). Bootstrap
already runs the target over exactly these tokens to generate them: :class:`FeatureCapture` keeps what
those forwards compute (the prompt's prefill, then one decode step per generated token) and
:class:`FeatureStore` writes it next to the traces, one safetensors file per sequence keyed by its token
ids. Training (:class:`~dspark_core.training.train.FeatureSource`) reads a sequence from the store when it is there
and runs the target only for the rest (traces from serving, an older bootstrap, other tap layers).

What a captured sequence holds, for tokens ``prompt + completion`` of length S (P prompt tokens):
taps and final hidden states at every position but the last (the last generated token is never fed
back); the log-normaliser at the generated positions P .. S-2 (the only positions whose next-token
distribution a training slot asks for). Positions without a value carry zeros in the hidden states and
a log-normaliser of ``NO_LSE``, which makes every probability there exactly zero, never NaN.

The features come from batched decode steps instead of one prefill per sequence, in the dtype bootstrap
ran in: they agree with a prefill up to the rounding of differently shaped matmuls (the tests hold fp32
to 1e-4; bf16 differs by bf16 rounding).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark_core.drafters import drafter_config

NO_LSE = 1.0e4                 # log-normaliser of positions with no target distribution: exp(z - NO_LSE) == 0


def training_taps(arch) -> tuple[int, ...]:
    """The tap layers bootstrap captures by default: those of the default DSpark/DFlash and Eagle3
    drafters of this target (one store serves all three)."""
    return tuple(sorted({t for k in ("dspark", "eagle3") for t in drafter_config(k, arch).target_layer_ids}))


def sequence_key(token_ids: list[int]) -> str:
    """Content key of a token sequence (sha1 of its int32 bytes)."""
    return hashlib.sha1(torch.tensor(token_ids, dtype=torch.int32).numpy().tobytes()).hexdigest()


class FeatureStore:
    """Captured target features under ``root`` (``<home>/features/<target fingerprint>``)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    @classmethod
    def for_target(cls, home: Path, fingerprint: str) -> "FeatureStore":
        return cls(Path(home) / "features" / fingerprint[:16])

    def path(self, token_ids: list[int]) -> Path:
        key = sequence_key(token_ids)
        return self.root / key[:2] / f"{key}.safetensors"

    def put(self, token_ids: list[int], taps: tuple[int, ...], tap_values: torch.Tensor, last: torch.Tensor,
            lse: torch.Tensor) -> Path:
        """Store one sequence: tap_values [S, len(taps) * d], last [S, d] (runner dtype), lse [S] fp32."""
        S = len(token_ids)
        if tap_values.shape[0] != S or last.shape[0] != S or lse.shape != (S,):
            raise ValueError(f"features of a {S}-token sequence must have S rows: taps {tuple(tap_values.shape)}, "
                             f"last {tuple(last.shape)}, lse {tuple(lse.shape)}")
        path = self.path(token_ids)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({"tokens": torch.tensor(token_ids, dtype=torch.int32), "taps": tap_values.contiguous().cpu(),
                   "last": last.contiguous().cpu(), "lse": lse.float().contiguous().cpu()}, str(tmp),
                  metadata={"taps": ",".join(str(t) for t in taps)})
        os.replace(tmp, path)                         # readers never see a half-written file
        return path

    def get(self, token_ids: list[int], length: int | None = None
            ) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(tap layers, taps [n, F], last [n, d], lse [n]) of the first ``length`` positions (default all)
        of the stored sequence ``token_ids``, or None when it is not stored (or the file does not hold
        exactly these tokens)."""
        path = self.path(token_ids)
        if not path.exists():
            return None
        n = len(token_ids) if length is None else length
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if not torch.equal(f.get_tensor("tokens"), torch.tensor(token_ids, dtype=torch.int32)):
                    return None
                taps = tuple(int(t) for t in meta.get("taps", "").split(",") if t != "")
                return taps, f.get_slice("taps")[:n], f.get_slice("last")[:n], f.get_slice("lse")[:n]
        except Exception:                              # an unreadable file is a miss: the target recomputes it
            return None


class FeatureCapture:
    """Collects, per request (by its key), what :func:`~dspark_core.engine.plain_batch.generate_batch`'s target forwards
    compute, and stores each finished sequence in a :class:`FeatureStore`. ``only``: the request keys to
    capture (default all; bootstrap passes its training prompts' requests: held-out sequences never train)."""

    def __init__(self, store: FeatureStore, taps: tuple[int, ...], only: set | None = None):
        self.store, self.taps, self.only = store, tuple(taps), only
        self._rows: dict[object, dict] = {}
        self.stored = 0

    def prefill(self, key, out) -> None:
        """The prompt's prefill: out.taps [1, P, F], out.last_hidden [1, P, d]."""
        if self.only is not None and key not in self.only:
            return
        self._rows[key] = {"taps": [out.taps[0]], "last": [out.last_hidden[0]], "lse": []}

    def step(self, key, out, i: int) -> None:
        """One decode step, batch row ``i`` of ``out`` (logits [B, 1, V] fp32), fed one generated token."""
        r = self._rows.get(key)
        if r is None:
            return
        r["taps"].append(out.taps[i])
        r["last"].append(out.last_hidden[i])
        r["lse"].append(out.logits[i, 0].logsumexp(-1).reshape(1))

    def finish(self, key, prompt_ids: list[int], token_ids: list[int]) -> None:
        """Store the finished sequence ``prompt_ids + token_ids`` of request ``key``."""
        r = self._rows.pop(key, None)
        if r is None:
            return
        ids = list(prompt_ids) + list(token_ids)
        taps, last = torch.cat(r["taps"]), torch.cat(r["last"])             # [S - 1, .]: the last token was not fed
        P, S = len(prompt_ids), len(ids)
        if taps.shape[0] != S - 1 or len(r["lse"]) != S - 1 - P:
            raise RuntimeError(f"captured {taps.shape[0]} positions of a {S}-token sequence")
        taps = torch.cat([taps, taps.new_zeros(1, taps.shape[1])])
        last = torch.cat([last, last.new_zeros(1, last.shape[1])])
        lse = torch.full((S,), NO_LSE)
        if r["lse"]:
            lse[P:S - 1] = torch.cat(r["lse"]).float().cpu()
        self.store.put(ids, self.taps, taps, last, lse)
        self.stored += 1
