#!/usr/bin/env bash
# Check a GPU machine before serving on it: a random-weight checkpoint of a real shape (a folder with
# config.json and the tokenizer files, e.g. a prepared target's folder without its weights) is registered
# as a target, then `dspark bench --suite device` runs on it (lossless fp32 checks, bf16 timing, SPS(B),
# the serving path's throughput). Weights are random on purpose: nothing large has to reach the machine.
#   docker/gpu-check.sh SHAPE_DIR [OUT_DIR]      (DEVICE=cuda by default; QUICK=1 for a smoke run)
set -euo pipefail
shape=${1:?usage: docker/gpu-check.sh SHAPE_DIR [OUT_DIR]}
out=${2:-bench-out}
device=${DEVICE:-cuda}
py=${PYTHON:-python3}
export DSPARK_HOME=${DSPARK_HOME:-/tmp/dspark-gpu-check} PYTHONUNBUFFERED=1
ckpt=$DSPARK_HOME/checkpoints/$(basename "$shape")
mkdir -p "$out" "$ckpt"
"$py" - "$shape" "$ckpt" <<'PY'
import shutil, sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
model.save_pretrained(dst)
for f in src.iterdir():
    if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "dspark_target.json"):
        shutil.copy(f, dst / f.name)
print(f"random-weight checkpoint of {src.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
PY
"$py" -m dspark_core.cli target prepare --model "$ckpt" --name gpu-check --force
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
"$py" -m dspark_core.cli bench --suite device --device "$device" --target gpu-check --json --out "$out" \
  "${quick[@]}" > "$out/device.json"
"$py" -c "import json,sys; from dspark_core.bench.device import render_markdown; \
print(render_markdown(json.load(open(sys.argv[1]))))" "$out/device.json" | tee "$out/device.md"
