#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent CUDA machine (CI never has one):
#   0. `capline train` through Ray Train with train.use_gpu=true for CapPa, CLIP* and SigLIP (first:
#      the path users run; CapPa's CPU generator failed there at step 1);
#   1. B/16 CapPa and CLIP* training throughput and MFU in bf16 (benchmarks/train.py's CUDA path);
#   2. every family's forward, loss and decoding on CUDA (the device bugs the meta test guards);
#   3. `capline experiment paper --budget gpu-8min` on the demo's shards, if capline's pipeline
#      dependencies are installed there (the demo run is made first, on the loopback server).
# Usage: bash benchmarks/gpu.sh [OUT_DIR]   (each step has its own time limit; total under ~9 min)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-benchmarks/results}}"
mkdir -p "$OUT"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
echo "== python: $PY"
"$PY" - <<'PY' || { echo "gpu.sh: no CUDA torch here; nothing to measure"; exit 2; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0),
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY
echo "== 0. the Ray Train path with use_gpu: true (CapPa, CLIP*, SigLIP), on the demo's shards"
if "$PY" -c "import ray, mlflow, img2dataset" 2>/dev/null && [ -x .venv/bin/capline ]; then
  export CAPLINE_NETGUARD=1
  timeout 150 .venv/bin/capline run configs/demo.yaml --run-dir "$OUT/demo" --until shard 2>&1 | tail -3
  for fam in cappa clip siglip; do
    timeout 120 .venv/bin/capline train --run-dir "$OUT/demo" --set train.use_gpu=true --set train.num_workers=1 \
      --set train.model=$fam --set train.steps=20 --set train.checkpoint_every=10 --set train.optim.warmup_steps=2 \
      2>&1 | tee "$OUT/gpu_raytrain_$fam.txt" | tail -4
    echo "   $fam: exit ${PIPESTATUS[0]}"
  done
else
  echo "gpu.sh: capline's pipeline dependencies (ray, mlflow, img2dataset in .venv) are not installed here; step 0 skipped"
fi
echo "== 1. throughput and MFU (bf16)"
timeout 240 "$PY" benchmarks/train.py --skip-side-by-side --throughput --steps 10 --loader-workers "${LOADER_WORKERS:-8}" --peak-tflops "${PEAK_TFLOPS:-989}" 2>&1 | tee "$OUT/gpu_train.txt"
cp benchmarks/results/train.json "$OUT/gpu_train.json" 2>/dev/null || true
echo "== 2. every family on CUDA"
timeout 120 "$PY" - <<'PY' 2>&1 | tee "$OUT/gpu_families.txt"
import torch
from trainers.models import ModelConfig, build_model
from trainers.models.decoding import beam_search, greedy
for fam in ("cap", "cappa", "clip", "siglip", "coca", "clipcap"):
    kw = dict(family=fam, size="tiny", vocab_size=64, max_len=8, image_size=32, patch=8, width=64, depth=2,
              heads=2, mlp=128, caption_queries=4, prefix_len=3, image_embed_dim=64 if fam == "clipcap" else None)
    m = build_model(ModelConfig(**kw)).cuda()
    x = torch.randn(2, 64, device="cuda") if fam == "clipcap" else torch.randn(2, 3, 32, 32, device="cuda")
    y = torch.randint(3, 64, (2, 8), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = m.loss(x, y)
    loss.backward()
    done = [f"loss {loss.item():.3f}"]
    m.eval()
    with torch.no_grad():
        if fam in ("cap", "cappa", "coca", "clipcap"):
            done += [f"greedy {tuple(greedy(m, x, 8).shape)}", f"beam {tuple(beam_search(m, x, 8, beam=2).shape)}"]
        if fam in ("clip", "siglip", "coca"):
            done.append(f"score {tuple(m.score(x, y).shape)}")
    print(f"{fam:<8} ok: " + ", ".join(done))
PY
echo "== 3. capline experiment paper --budget gpu-8min"
if "$PY" -c "import ray, mlflow, img2dataset" 2>/dev/null && [ -x .venv/bin/capline ]; then
  export CAPLINE_NETGUARD=1
  timeout 330 .venv/bin/capline experiment paper --run-dir "$OUT/demo" --budget gpu-8min 2>&1 | tee "$OUT/gpu_paper.txt" | tail -15
else
  echo "gpu.sh: capline's pipeline dependencies (ray, mlflow, img2dataset in .venv) are not installed here; step 3 skipped"
fi
