"""The application builder: an `AppConfig` (the `args` of a Serve YAML, or `mars-ray serve`'s flags) as a
Serve application: the OpenAI ingress (`ingress.py`), one engine deployment per model (`replica.py`, with
its engine) and the status board (`status_board.py`). `build_app` is the `import_path` of the YAMLs in
`serve_configs/`.
"""

from __future__ import annotations

from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, BackpressureConfig
from ray.serve.deployment import Application

from mars_ray.serve.config import AppConfig, ModelConfig
from mars_ray.serve.engine import Engine
from mars_ray.serve.ingress import OpenAIIngress
from mars_ray.serve.policy import tau_first_policy
from mars_ray.serve.protocol import ServingEngine
from mars_ray.serve.replica import EngineDeployment
from mars_ray.serve.status_board import StatusBoard
from mars_ray.serve.vllm_engine import VllmEngine

ENGINES: dict[str, type[ServingEngine]] = {"native": Engine, "vllm": VllmEngine}  # by `ModelConfig.engine`


def build_app(args: dict | AppConfig) -> Application:
    """The application for an `AppConfig` (the `args` of a Serve YAML)."""
    config = AppConfig.model_validate(args)
    board = StatusBoard.bind()
    # The tau knobs reach replicas only as user_config: with them out of the constructor's arguments, a
    # `serve deploy` that changes only them updates running replicas in place instead of replacing them.
    engines = {
        model.served_name: _engine_deployment(model).bind(
            model.model_copy(update={"tau_control": None}), board, ENGINES[model.engine]
        )
        for model in config.models
    }
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        # The ingress holds the HTTP streams: replaced, it drains them as long as the engines do.
        graceful_shutdown_timeout_s=max(m.graceful_shutdown_timeout_s for m in config.models),
    ).bind(engines, board, config)


def _engine_deployment(model: ModelConfig):
    """The engine deployment of one model: resources, backpressure, tau knobs, replica autoscaling."""
    options = dict(
        name=model.deployment_name,
        ray_actor_options={"num_cpus": model.num_cpus, "num_gpus": model.num_gpus},
        max_ongoing_requests=model.max_ongoing_requests,
        max_queued_requests=model.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=model.retry_after_s),
        max_constructor_retry_count=3,  # a model that does not load fails soon, not after 20 tries
        # A replica being replaced (a redeploy that restarts it) or removed (scale-in) first finishes its
        # requests, streams included, for up to this long.
        graceful_shutdown_timeout_s=model.graceful_shutdown_timeout_s,
    )
    if model.tau_control:
        options["user_config"] = model.tau_control.model_dump()
    if model.max_replicas and model.max_replicas > model.num_replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=model.num_replicas,
            max_replicas=model.max_replicas,
            upscale_delay_s=model.upscale_delay_s,
            downscale_delay_s=model.downscale_delay_s,
            look_back_period_s=model.look_back_period_s,
            policy=AutoscalingPolicy(policy_function=tau_first_policy),
        )
    else:
        options["num_replicas"] = model.num_replicas
    return EngineDeployment.options(**options)
