#!/usr/bin/env bash
# The GPU figures for SmolLM2-135M-Instruct, in one go on one GPU: MARS recipes compared along their learning
# curves (scripts/recipe_sweep.py: the Ray Train workers' step code in one process), then the last recipe's
# checkpoint through the tau sweep (`mars-ray eval`, lossy and verified, against the untouched instruct
# model), the decode benchmark (`mars-ray bench decode`, against HF generate on the base model) and the cost
# of a window (`mars-ray bench forward`), each writing JSON under OUT.
#
#   bash scripts/gpu_bench.sh [OUT]          # default OUT: results/gpu-bench; about 8 minutes on one H200
#
# Nothing here needs Ray, so it also runs on a lent machine that has torch but no package registry:
# PYTHON (default .venv/bin/python, else python3) with this repository on PYTHONPATH. DISTILLED: a
# `mars-ray distill` folder to train on (default: distilled on the GPU first). PHASES: the phases to run
# (default: all; a later phase reads what an earlier one left in OUT). Without a GPU (or with SMALL=1) it
# runs the same steps, small. Ray Train on GPU workers: configs/smollm2.yaml, k8s/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-results/gpu-bench}")
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
distilled=()
[ -n "${DISTILLED:-}" ] && distilled=(--distilled "$DISTILLED")

if [ "${SMALL:-0}" != 1 ] && $python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  device=cuda
  sweep=(--points 800 1600 3200 6400 --deadline-s "${SWEEP_DEADLINE_S:-330}"
    --recipes "lr=1e-4" "lr=1e-4 block_offsets=4" "lr=3e-4 block_offsets=4")
  evaluate=(--tasks-limit 64 --dialogs-limit 64 --batch-size 64 --taus 1.0 0.9 0.7 0.5)
  bench=(--prompts 8 --batch-sizes 1 4 16 --repeats 1 --dtype bfloat16)
  forward=(--batch-sizes 1 4 16 --dtype bfloat16)
else
  device=cpu
  sweep=(--points 8 16 --recipes "lr=1e-4" "lr=1e-4 block_offsets=4" --distill-limit 16
    --dialogs-limit 4 --tasks-limit 4 --max-new-tokens 16)
  evaluate=(--tasks-limit 4 --dialogs-limit 2 --max-new-tokens 16 --taus 1.0 0.9 0.5)
  bench=(--prompts 2 --max-new-tokens 16 --batch-sizes 1 2 --repeats 1)
  forward=(--batch-sizes 1 --windows 1 4 --steps 4)
fi

started=$(date +%s)
failed=()
phase() { echo "[gpu_bench] $1: $(($(date +%s) - started)) s"; }
mars() { $python -m mars_ray.cli "$@"; }
# A phase in PHASES runs; one that fails is reported and the others still run (the exit status says so).
run() {
  local name=$1; shift
  [[ " ${PHASES:-sweep eval bench forward vllm} " == *" $name "* ]] || return 0
  phase "$name"
  "$@" || failed+=("$name")
}

phase "prepare smollm2-135m on $device ($($python -c 'import torch; print(torch.__version__)'))"
mars prepare --model smollm2-135m
run sweep $python scripts/recipe_sweep.py --device $device "${sweep[@]}" "${distilled[@]}" \
  --output "$out/sweep.jsonl" --save "$out/mars-final"
run eval mars eval --model "$out/mars-final" --baseline smollm2-135m --modes lossy verify --device $device \
  "${evaluate[@]}" --output "$out/eval.json" --plot "$out/pareto.png"
run bench mars bench decode --model "$out/mars-final" --baseline smollm2-135m --device $device "${bench[@]}" \
  --methods ar ar-sliding prompt-lookup mars-cached mars-verify mars-block --cache-blocks 16 32 \
  --output "$out/decode.json"
run forward mars bench forward --model "$out/mars-final" --device $device "${forward[@]}" \
  --output "$out/forward.json"
# The same checkpoint on vLLM with MARS as its speculative method (the project's serving path): the tau
# sweep, exactness against HF generate and tokens per forward. vLLM must be installed there (the official
# `vllm`, `pip install -e ".[vllm-gpu]"`); without it the phase says so and is skipped.
if $python -c "import vllm" 2>/dev/null; then
  run vllm mars eval --model "$out/mars-final" --engine vllm --modes lossy verify --check-greedy \
    "${evaluate[@]}" --output "$out/eval-vllm.json"
else
  phase "vllm: skipped (vllm is not installed for $python)"
fi

phase "done${failed:+, failed: ${failed[*]}}"
echo "[gpu_bench] results: $out/{sweep.jsonl,eval.json,decode.json,forward.json,eval-vllm.json,pareto.png}"
[ ${#failed[@]} -eq 0 ]
