#!/usr/bin/env bash
# A real serving peer in the same run: vLLM's own OpenAI server and mars-ray serve the same model folder on
# 127.0.0.1, and one client (`mars_ray.bench.loadtest`) drives both with the same held-out prompts,
# concurrency and token budget, the settings taking turns round by round.
#
#   bash scripts/vllm_peer.sh MODEL_DIR [OUT] [CONCURRENCY ...]    # default OUT results/vllm-peer; 1 4 16
#
# REQUESTS (per setting; default 16, or 4 x concurrency above 4) and ROUNDS (default 2) size the run; DTYPE
# (float32, the default, or bfloat16: vLLM's CPU default, which pays on a CPU with AMX) is both servers';
# STREAM_INTERVAL_S (default 0.05) is the mars-ray replica's stream_interval_s (vLLM streams every token);
# COMPILE=1 gives the native replica compiled decode steps (`compile: true`). SOURCE (chatterbot, the
# default, tasks, or mix: a task and a dialog in turn) picks the held-out prompts; TAUS (default 0.9) and
# VERIFY_TAUS (default 0.5) the MARS rows.
# ENGINE=vllm serves mars-ray's replica on vLLM with MARS as its speculative method (the product's path);
# PEER_SPEC=ngram gives the peer vLLM's own lossless prompt-lookup drafting (ngram, k = 3, lookup 1-4): the
# draft-model-free method a vLLM user would try first. PEER=serve-llm makes the peer Ray Serve LLM's own app
# (`build_openai_app`, vLLM inside Ray Serve: `mars_ray.bench.serve_llm_peer`) instead of vLLM's server.
# PEER_ARGS adds the peer's own flags (e.g. PEER_ARGS=--no-async-scheduling; vLLM's server only).
#
# Both servers get both cores (VLLM_CPU_OMP_THREADS_BIND=0-1; the mars-ray replica 2 torch threads): only one
# of them is loaded at a time. vLLM is the venv's own (`bash scripts/setup.sh` installs vllm-cpu beside torch).
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(realpath "$1")
out=$(realpath -m "${2:-results/vllm-peer}")
shift $(( $# >= 2 ? 2 : $# ))
levels=("${@:-1 4 16}")
port=8200
dtype=${DTYPE:-float32}
mkdir -p "$out"
spec=()
method=AR
if [ "${PEER_SPEC:-}" = ngram ]; then
  spec=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}')
  method="ngram k 3"
fi

peer_env=(VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1)
if [ "${PEER:-vllm}" = serve-llm ]; then
  label="Ray Serve LLM 2.60 + vLLM-CPU 0.32.0 ($method, $dtype)"
  env "${peer_env[@]}" RAY_AUTH_MODE=disabled .venv/bin/python -m mars_ray.bench.serve_llm_peer --model "$model" --name peer \
    --port $port --dtype "$dtype" --max-model-len 2048 "${spec[@]}" > "$out/vllm.log" 2>&1 &
else
  label="vLLM-CPU 0.32.0 ($method, $dtype)"
  # `vllm serve` fails on the package name (vllm-cpu): start the OpenAI server module directly.
  read -ra peer_args <<< "${PEER_ARGS:-}"
  [ -n "${PEER_ARGS:-}" ] && label="$label ${PEER_ARGS}"
  env "${peer_env[@]}" .venv/bin/python -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name peer \
    --host 127.0.0.1 --port $port --dtype "$dtype" --max-model-len 2048 "${spec[@]}" "${peer_args[@]}" \
    > "$out/vllm.log" 2>&1 &
fi
peer=$!
trap 'kill $peer 2>/dev/null || true; wait $peer 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do  # 2 to 4 minutes of compile and warm-up
  curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
  kill -0 $peer 2>/dev/null || { tail -20 "$out/vllm.log"; exit 1; }
  sleep 3
done
curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null

for concurrency in ${levels[*]}; do
  RAY_AUTH_MODE=disabled .venv/bin/python -m mars_ray.bench.loadtest --model "$model" \
    --concurrency "$concurrency" --requests "${REQUESTS:-$((concurrency > 4 ? 4 * concurrency : 16))}" \
    --rounds "${ROUNDS:-2}" \
    --max-tokens 64 --source "${SOURCE:-chatterbot}" --taus ${TAUS:-0.9} --verify-taus ${VERIFY_TAUS:-0.5} --num-cpus 2 --torch-threads 2 --dtype "$dtype" \
    --stream-interval-s "${STREAM_INTERVAL_S:-0.05}" ${COMPILE:+--compile} --engine "${ENGINE:-native}" \
    --peer-url "http://127.0.0.1:$port" --peer-name peer --peer-label "$label" \
    --output "$out/concurrency-$concurrency.json" | tee "$out/concurrency-$concurrency.md"
done
