"""What a MARS checkpoint asks of vLLM: read from the checkpoint, never repeated by the user."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from transformers import AutoConfig, AutoTokenizer

from mars_ray.core import gated
from mars_ray.core.decode_config import TRAINED_BLOCK_SIZE
from mars_ray.core.dtypes import DtypeName
from mars_ray.core.errors import ConfigError
from mars_ray.vllm import gated as vllm_gated
from mars_ray.vllm.passes import METRICS_LEVEL

PROPOSER = "mars_ray.vllm.proposer.MarsProposer"
WORKER_EXTENSION = "mars_ray.vllm.worker.MarsWorker"  # the operating point a replica moves at run time

Engine = Literal["native", "vllm"]  # what decodes: this project's decoders, or vLLM with the MARS proposer
ENGINE_HELP = "native: this project's decoder (the reference); vllm: vLLM with MARS as its speculative method"


def trained_block_size(model: str | Path) -> int | None:
    """The B a checkpoint was trained with (`mars_block_size` in its config.json); None if it records none."""
    config = Path(model) / "config.json"
    if not config.is_file():
        raise ConfigError("model", f"{model}: no config.json (a local MARS checkpoint folder is needed)")
    block_size = json.loads(config.read_text()).get(TRAINED_BLOCK_SIZE)
    return int(block_size) if block_size else None


def speculative_config(model: str | Path) -> dict:
    """vLLM's `speculative_config` for MARS on `model`: room for B - 1 carried proposals and B - 1 masks
    in each forward, so that a request whose proposals all hold gets its next ones from the same forward."""
    block_size = trained_block_size(model) or 0
    if block_size < 2:
        raise ConfigError("model", f"{model} was trained with B = {block_size}: nothing to draft")
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 2 * (block_size - 1)}


def is_mars_checkpoint(model: str | Path) -> bool:
    """A folder MARS training wrote: it records its B and its tokenizer has a mask token. A base `prepare`
    gave a mask token but that never trained has nothing to draft with: vLLM serves it as plain AR."""
    if trained_block_size(model) is None:
        return False
    return AutoTokenizer.from_pretrained(model).mask_token is not None


def mars_engine_args(model: str | Path, dtype: DtypeName = "auto") -> dict:
    """vLLM engine arguments for `model` (its `model` and `dtype` among them): MARS as its speculative method,
    with the per-request metrics a request's forward passes are counted from and the worker call that moves
    the operating point (`mars_ray.vllm.worker`), where it is a MARS checkpoint; for a gated folder, its base
    as vLLM's model with the adapter attached (`mars_ray.vllm.gated`); a plain model as it is (vLLM refuses
    speculative metrics without a speculative method)."""
    if not is_mars_checkpoint(model):
        args = {"model": str(model)}
    else:
        args = {"speculative_config": speculative_config(model)}
        args |= {"per_request_spec_decode_metrics": METRICS_LEVEL, "worker_extension_cls": WORKER_EXTENSION}
        args |= vllm_gated.engine_args(model) if gated.read_spec(model) is not None else {"model": str(model)}
    return args | {"dtype": saved_dtype(args["model"]) if dtype == "auto" else dtype}


def saved_dtype(model: str) -> str:
    """The dtype `model`'s weights were saved in, which "auto" means here as in `from_pretrained`: vLLM's
    own "auto" would run a float32 checkpoint in bfloat16, unlike the native engine and the HF baseline."""
    return str(AutoConfig.from_pretrained(model).dtype or "float32").removeprefix("torch.")


def cpu_bind(threads: int) -> str:
    """vLLM-CPU's `VLLM_CPU_OMP_THREADS_BIND` for an engine of `threads` OpenMP threads: the first cores this
    process may run on. vLLM's own "auto" reserves a core per engine for its scheduler process, which on a
    2-core machine halves the cores that decode (BENCHMARKS.md, "vLLM's own ngram ...")."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(str(core) for core in cores[: max(1, threads)])
