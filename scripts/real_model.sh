#!/usr/bin/env bash
# The real model, end to end on this machine: SmolLM2-135M-Instruct MARS-trained on Ray Train from its own
# distilled replies (configs/smollm2-cpu.yaml), calibrated, then measured against the untouched instruct
# model. Every step skips what is already done, so rerunning the same command resumes where it stopped.
#
#   bash scripts/real_model.sh              # about 3.5 hours on 2 CPU cores (distill 12 min, train 2.4 h)
#   GATED=1 bash scripts/real_model.sh      # gated adapters instead (configs/smollm2-cpu-gated.yaml): the
#                                           # instruct model kept exactly; the task prompts distilled too
#
# Leaves the checkpoint at $MARS_RAY_HOME/runs/smollm2-cpu/mars/final (gated: runs/smollm2-cpu-gated/, a
# gated folder naming its base) and the reports beside it in .../reports/ (with vLLM installed, the served
# checkpoint on vLLM + MARS against a standalone vLLM server too: reports/serving-*/, reports/ramp-vllm/).
# Run `bash scripts/setup.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
home=$(realpath -m "${MARS_RAY_HOME:-$HOME/.cache/mars-ray}")
export MARS_RAY_HOME=$home RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
bin=.venv/bin
gated=${GATED:-0}
recipe=smollm2-cpu
[ "$gated" = 1 ] && recipe=smollm2-cpu-gated
run=$home/runs/$recipe
distilled=$home/distill/smollm2-chatterbot
distilled_tasks=$home/distill/smollm2-tasks
reports=$run/reports
mkdir -p "$reports"
started=$(date +%s)
phase() { echo "[real_model] $1: $(($(date +%s) - started)) s"; }

phase "prepare"
$bin/mars-ray prepare --model smollm2-135m

# vLLM writes the replies several times faster than the native batcher where it is installed (setup.sh does)
engine=native
$bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" && engine=vllm
phase "distill ($engine)"   # resumable: finished shards are skipped
$bin/mars-ray distill --model smollm2-135m --prompts chatterbot-prompts chatterbot --max-new-tokens 96 \
  --batch-size 48 --shard-size 128 --engine $engine --output "$distilled"

datasets="[$distilled, tasks]"
if [ "$gated" = 1 ]; then  # the drafts learn the verifier's own text: its replies to the task prompts too
  phase "distill tasks"
  $bin/mars-ray distill --model smollm2-135m --prompts tasks --tasks-count 1000 --max-new-tokens 96 \
    --batch-size 48 --shard-size 128 --engine $engine --output "$distilled_tasks"
  datasets="[$distilled, $distilled_tasks]"
fi

phase "train"     # resumable: the run continues from its last checkpoint
$bin/mars-ray train --config configs/$recipe.yaml "datasets=$datasets" output_dir="$home/runs"

final=$run/mars/final
if [ "$gated" = 1 ]; then
  phase "plain transformers loads the base; mars_ray.models loads the gated folder on it"
  $bin/python -c "import sys, json; from transformers import AutoModelForCausalLM; from mars_ray import models
base = json.load(open(sys.argv[1] + '/config.json'))['mars_gated']['base']
m = AutoModelForCausalLM.from_pretrained(base); g, t = models.load(sys.argv[1])
print('base', base, m.num_parameters(), 'parameters; gated B =', g.config.mars_block_size, '; mask', t.mask_token)" "$final"
else
  phase "plain transformers loads it"
  $bin/python -c "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); t = AutoTokenizer.from_pretrained(sys.argv[1])
print(type(m).__name__, m.num_parameters(), 'parameters; B =', m.config.mars_block_size, '; mask', t.mask_token)" "$final"
fi

phase "calibrate"
[ -f "$final/calibration.json" ] || $bin/mars-ray calibrate --model "$final" --tasks-limit 100 --dialogs-limit 100 \
  --plot "$reports/reliability.png"

phase "eval"
[ -f "$reports/eval.json" ] || $bin/mars-ray eval --model "$final" --baseline smollm2-135m --check-greedy \
  --taus 1.0 0.9 0.7 0.5 --dialogs-limit 64 --tasks-limit 100 --batch-size 32 \
  --output "$reports/eval.json" --plot "$reports/pareto.png"
phase "eval, verified"
[ -f "$reports/eval-verify.json" ] || $bin/mars-ray eval --model "$final" --modes verify \
  --taus 0.9 0.7 0.5 --confidences calibrated --dialogs-limit 64 --tasks-limit 100 --batch-size 32 \
  --output "$reports/eval-verify.json"

# bf16 only where the CPU has it natively: emulated (AVX2 only), it is many times slower than fp32.
dtypes=float32
$bin/python -c "import sys, torch; sys.exit(not torch.cpu._is_avx512_bf16_supported())" && dtypes="bfloat16 float32"
for dtype in $dtypes; do
  phase "bench forward $dtype"
  if [ "$gated" = 1 ]; then  # the gate's cost: the base's plain step beside its step with an r 32 adapter
    [ -f "$reports/forward-$dtype.json" ] || $bin/mars-ray bench forward --model smollm2-135m --dtype $dtype \
      --gated-rank 32 --steps 24 --output "$reports/forward-$dtype.json"
  else
    [ -f "$reports/forward-$dtype.json" ] || $bin/mars-ray bench forward --model "$final" --dtype $dtype \
      --steps 24 --output "$reports/forward-$dtype.json"
  fi
  phase "bench decode $dtype"
  [ -f "$reports/decode-$dtype.json" ] || $bin/mars-ray bench decode --model "$final" --baseline smollm2-135m \
    --dtype $dtype --prompts 8 --max-new-tokens 48 --batch-sizes 1 4 --repeats 2 \
    --methods ar ar-sliding prompt-lookup mars-cached mars-verify --output "$reports/decode-$dtype.json"
done
phase "learning curve"
[ -f "$reports/curve.json" ] || $bin/python scripts/learning_curve.py --run "$run" --baseline smollm2-135m \
  --sources chatterbot tasks --dialogs-limit 48 --tasks-limit 48 --output "$reports/curve.json"

# The product's serving path, bf16 (issue 28's figures): a vLLM + MARS replica beside `vllm serve` of the same
# folder on the held-out mix (the floors), dialogs and tasks; the native engine beside vLLM's own ngram
# drafting; the load ramp with the controller on a vLLM replica. A gated folder is not a model `vllm serve`
# loads: its peer would be the base, run by hand.
if [ "$engine" = vllm ] && [ "$gated" != 1 ]; then
  for source in mix chatterbot tasks; do
    phase "bench serving on vLLM, held-out $source"
    [ -f "$reports/serving-$source/concurrency-16.json" ] || SOURCE=$source DTYPE=bfloat16 ENGINE=vllm \
      VERIFY_TAUS="0.9 0.5" bash scripts/vllm_peer.sh "$final" "$reports/serving-$source" 1 4 16
  done
  phase "bench serving: the native engine beside vLLM ngram, held-out mix"
  [ -f "$reports/serving-mix-native/concurrency-16.json" ] || SOURCE=mix DTYPE=bfloat16 ENGINE=native \
    PEER_SPEC=ngram VERIFY_TAUS="0.9 0.5" bash scripts/vllm_peer.sh "$final" "$reports/serving-mix-native" 1 4 16
  phase "the load ramp with the controller on a vLLM replica, held-out mix"
  [ -f "$reports/ramp-vllm/ramp.json" ] || $bin/python -m mars_ray.bench.ramp --model "$final" --engine vllm \
    --dtype bfloat16 --num-cpus 2 --source mix --target 0.08 --verify-tau 0.5 --stream-interval-s 0.05 --rounds 2 \
    --out "$reports/ramp-vllm"
fi

phase "done"
echo "[real_model] checkpoint: $final; reports: $reports"
