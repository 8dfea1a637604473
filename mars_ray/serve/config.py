"""The serving configuration: one typed object, the `args` of a Serve YAML and of `mars-ray serve`."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.dtypes import DtypeName
from mars_ray.vllm.config import ENGINE_HELP, Engine

API_KEY_VARIABLE = "MARS_RAY_API_KEY"


def _checked_by(check: Callable[[Any, str], Any]) -> AfterValidator:
    """A field checked by `check(value, field name)` (None, where a field may be unset, passes)."""

    def checked(value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            check(value, info.field_name)
        return value

    return AfterValidator(checked)


# Every tau and window a config or a request body carries: their ranges are `DecodeConfig`'s.
Tau = Annotated[float, _checked_by(DecodeConfig.check_tau)]
TauOrNone = Annotated[float | None, _checked_by(DecodeConfig.check_tau)]
BlockSize = Annotated[int, _checked_by(DecodeConfig.check_block_size)]
BlockSizeOrNone = Annotated[int | None, _checked_by(DecodeConfig.check_block_size)]
# A replica's stream interval, seconds (`ModelConfig.stream_interval_s`; the bench drivers' flag for it)
StreamInterval = Annotated[float, Field(ge=0, le=1)]


class TauObjective(BaseModel):
    """The operator's knobs (Serve `user_config`, live): the quality floor, the ceiling and the objective."""

    model_config = ConfigDict(extra="forbid")

    tau_min: Tau = Field(0.7, description="quality floor: the controller never goes below")
    tau_max: Tau = Field(1.0, description="quality ceiling: where an idle replica sits")
    tau_step: float = Field(0.05, gt=0, le=1, description="how far tau moves per decision")
    verify_tau: TauOrNone = Field(
        None,
        lt=1,
        description="a lossless first step under load: verified decoding carrying proposals this confident"
        " (needs tau_max 1.0; None: no such step)",
    )
    metric: Literal["queue_depth", "ttft_p95", "itl_p95"] = Field(
        "queue_depth", description="what the objective bounds: waiting requests, or a latency percentile"
    )
    target: float = Field(4.0, gt=0, description="objective: waiting requests, or seconds for latencies")
    low_fraction: float = Field(0.5, ge=0, lt=1, description="raise tau below low_fraction x target")
    patience: int = Field(2, ge=1, description="ticks in a row before acting")
    interval_s: float = Field(1.0, gt=0, description="seconds between the controller's decisions")
    min_gain: float = Field(0.03, ge=0, description="a lower tau must raise the speed by this fraction")
    goodput_samples: int = Field(
        3,
        ge=1,
        description="ticks a point's speed is averaged over before it is compared or left downward (one"
        " tick's goodput is noisier than min_gain)",
    )
    memory_s: float = Field(60.0, gt=0, description="forget goodput measurements older than this")

    @model_validator(mode="after")
    def _ordered(self) -> TauObjective:
        if self.tau_min > self.tau_max:
            raise ValueError(f"tau_min ({self.tau_min}) must not exceed tau_max ({self.tau_max})")
        return self


def compiled_by_default(engine: Engine) -> bool:
    """vLLM compiles its graphs unless told not to, as `vllm serve` does (its eager mode was most of a vLLM
    replica's gap to a standalone vLLM server: BENCHMARKS.md); the native engine's torch.compile costs
    minutes at start, so it is asked for."""
    return engine == "vllm"


class ModelConfig(BaseModel):
    """One served model: its weights, its name in the API, how its replicas decode and how many there are."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="local HF folder, Hub id, or preset (tiny, smollm2-135m)")
    name: str | None = Field(None, description="the `model` clients ask for; default: derived from `model`")
    dtype: DtypeName = Field(
        "auto", description="weights' dtype (auto: as saved); bfloat16 pays on a CPU with AMX or AVX512-BF16"
    )
    device: str = Field("cpu", description="torch device of each replica (cuda: give it num_gpus)")
    engine: Engine = Field("native", description=ENGINE_HELP)
    tau: Tau = Field(1.0, description="operating tau, for requests that do not set their own")
    verify: bool = Field(
        False,
        description="operating mode for greedy requests that do not set `verify`: verified (lossless)"
        " decoding, where tau only picks the proposals checked",
    )
    block_size: BlockSizeOrNone = Field(
        None, description="window for requests that do not set their own; default: the trained B"
    )
    max_block_size: BlockSizeOrNone = Field(
        None,
        description="largest window a request may ask for; default: the trained B (16 for a model that"
        " records none). Set it above B to allow wider, untrained windows",
    )
    max_tokens: int = Field(256, ge=1, description="default completion budget when a request sets none")
    max_batch_size: int = Field(32, ge=1, description="rows decoded together per forward")
    max_prefill_tokens: int | None = Field(
        None,
        ge=1,
        description="chunked prefill: prompt tokens cached per forward while other requests decode (vLLM's"
        " max_num_batched_tokens, less the decode rows), so a long prompt stalls them by at most this much;"
        " None: a joining prompt is cached whole",
    )
    max_context: int | None = Field(None, ge=2, description="default: the model's max_position_embeddings")
    compile: bool | None = Field(
        None,
        description="compiled decode steps. native: torch.compile (faster steps in bf16, see BENCHMARKS.md),"
        " every kind of step compiled while the replica warms up: minutes on a CPU, less once torch's"
        " compile cache holds them. vllm: vLLM's compiled graphs (false: enforce_eager). Default: the"
        " engine's own, eager on native, compiled on vllm",
    )
    prepack_weights: bool = Field(
        True,
        description="eager steps in bf16 on a CPU with native bf16 (AVX512-BF16, AMX): every linear weight"
        " is packed once into oneDNN's blocked layout instead of at each call (faster steps, see"
        " BENCHMARKS.md); with `compile`, or elsewhere, it does nothing",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="the replica's compute threads (on vLLM, its cores); default: its whole CPUs"
    )
    stats_window_s: float = Field(10.0, gt=0, description="look-back of the engine's rates and percentiles")
    stream_interval_s: StreamInterval = Field(
        0.0,
        description="after a request's first text, the text of this interval crosses to the ingress as one"
        " chunk (fewer messages per token; text arrives up to this much later). 0: a chunk per forward",
    )
    num_replicas: int = Field(1, ge=1, description="replicas to start with")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves per replica (fractions allowed)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per replica")
    max_ongoing_requests: int = Field(64, ge=1, description="per replica: running plus waiting in the engine")
    max_queued_requests: int = Field(64, ge=0, description="per caller, beyond which requests get a 503")
    retry_after_s: float = Field(1.0, ge=0, description="the Retry-After a rejected request is given")
    graceful_shutdown_timeout_s: float = Field(
        120.0,
        ge=0,
        description="a replica restarted or scaled in first finishes its requests, up to this long",
    )
    tau_control: TauObjective | None = Field(
        None,
        description="load-adaptive tau; None keeps `tau` fixed. It becomes the engine deployment's "
        "user_config. In a Serve YAML put the knobs under `deployments: [{name: engine-<model>, "
        "user_config: ...}]` instead: there `serve deploy` applies changes without restarting replicas",
    )
    max_replicas: int | None = Field(
        None,
        ge=1,
        description="autoscale from num_replicas up to this, replicas last: a replica is added only while "
        "the tau controller (its user_config) has nothing left to trade",
    )
    upscale_delay_s: float = Field(5.0, ge=0, description="Serve waits this long before adding a replica")
    downscale_delay_s: float = Field(30.0, ge=0, description="and this long before removing one")
    look_back_period_s: float = Field(
        15.0,
        gt=0,
        description="Serve averages the replicas' reports over this; above Serve's 10 s metrics interval",
    )

    @property
    def compiled(self) -> bool:
        """Whether the replica's steps are compiled: `compile`, else the engine's own default."""
        return compiled_by_default(self.engine) if self.compile is None else self.compile

    @property
    def threads(self) -> int:
        """The replica's compute threads: `torch_threads`, else its whole CPUs, at least 1."""
        return self.torch_threads or max(1, int(self.num_cpus))

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.model.startswith(("/", ".", "~")):
            return Path(self.model).expanduser().name
        return self.model

    @property
    def deployment_name(self) -> str:
        """Serve deployment names may not hold `#`; keep them to a plain alphabet."""
        return "engine-" + re.sub(r"[^A-Za-z0-9_.-]", "-", self.served_name)

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.block_size and self.max_block_size and self.block_size > self.max_block_size:
            raise ValueError(f"block_size {self.block_size} exceeds max_block_size {self.max_block_size}")
        if self.max_ongoing_requests < self.max_batch_size:
            raise ValueError("max_ongoing_requests must be at least max_batch_size, or batches stay smaller")
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} is below num_replicas {self.num_replicas}")
        return self


class AppConfig(BaseModel):
    """The whole application: the models it serves and the ingress in front of them."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelConfig] = Field(min_length=1, description="the served models")
    ingress_num_cpus: float = Field(0.1, gt=0, description="CPUs Ray reserves for the OpenAI ingress")
    ingress_max_ongoing_requests: int = Field(1024, ge=1, description="requests the ingress holds at once")
    api_key: SecretStr | None = Field(
        None,
        validate_default=True,
        description="required as `Authorization: Bearer KEY` on every /v1 route (default: the"
        " MARS_RAY_API_KEY environment variable; neither: open)",
    )
    cors_origins: list[str] = Field(
        default_factory=list, description="browser origins allowed to call the API (none: CORS off)"
    )
    # Bounds on what one request may carry (the context, the batch and the queue bound the rest).
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request body size; larger: 413")
    max_messages: int = Field(256, ge=1, description="messages in one chat request; more: 400")
    max_n: int = Field(8, ge=1, description="choices (`n`) in one request; more: 400")
    max_stop_chars: int = Field(256, ge=1, description="characters in one stop string; longer: 400")

    @field_validator("api_key", mode="before")
    @classmethod
    def _key_from_environment(cls, key):
        return key if key is not None else os.environ.get(API_KEY_VARIABLE) or None

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.served_name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique: {names}")
        return models
