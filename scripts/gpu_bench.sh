#!/usr/bin/env bash
# The paper's proof on a real instruct model, in one go: AR SFT then MARS on SmolLM2-135M-Instruct (the offline
# preset) over the bundled data on Ray Train, then the tau sweep (`mars-ray eval`: agreement with the untouched
# instruct model, lossy and verified), the decode benchmark (`mars-ray bench decode`, against HF generate on
# the base model) and the cost of a window (`mars-ray bench forward`), each writing JSON under OUT.
#
#   bash scripts/gpu_bench.sh [OUT]        # default OUT: results/gpu-bench; about 10 minutes on one GPU
#
# Without a GPU (or with SMALL=1) it runs the same steps, small: a few training steps, a few prompts.
# Run `bash scripts/setup.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-results/gpu-bench}")
bin=.venv/bin
mkdir -p "$out"

if [ "${SMALL:-0}" != 1 ] && $bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  device=cuda
  train=(use_gpu=true num_workers=1 steps=300 batch_size=16 max_length=512 lr=2.0e-5 checkpoint_every=300)
  evaluate=(--tasks-limit 200 --dialogs-limit 100 --batch-size 32)
  bench=(--prompts 32 --batch-sizes 1 4 8 16 --cache-blocks 8 16 32 --dtype bfloat16)
  forward=(--batch-sizes 1 4 16 --dtype bfloat16)
else
  device=cpu
  train=(use_gpu=false num_workers=2 steps=3 batch_size=1 max_length=128 tasks_count=64 checkpoint_every=3)
  evaluate=(--tasks-limit 4 --dialogs-limit 2 --max-new-tokens 16 --taus 1.0 0.9 0.5)
  bench=(--prompts 2 --max-new-tokens 16 --batch-sizes 1 2 --cache-blocks 8)
  forward=(--batch-sizes 1 --windows 1 4 --steps 4)
fi

started=$(date +%s)
phase() { echo "[gpu_bench] $1: $(($(date +%s) - started)) s"; }
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

phase "prepare smollm2-135m on $device"
$bin/mars-ray prepare --model smollm2-135m
$bin/mars-ray train --config configs/smollm2.yaml name=gpu-bench output_dir="$out/runs" "${train[@]}"
run="$out/runs/gpu-bench"

phase "eval"
$bin/mars-ray eval --model "$run/mars/final" --baseline smollm2-135m --modes lossy verify --device "$device" \
  "${evaluate[@]}" --output "$out/eval.json" --plot "$out/pareto.png"

phase "bench decode"
$bin/mars-ray bench decode --model "$run/mars/final" --baseline smollm2-135m --device "$device" "${bench[@]}" \
  --output "$out/decode.json"

phase "bench forward"
$bin/mars-ray bench forward --model "$run/mars/final" --device "$device" "${forward[@]}" --output "$out/forward.json"

phase "done"
echo "[gpu_bench] results: $out/eval.json $out/decode.json $out/forward.json $out/pareto.png"
