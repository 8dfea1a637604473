"""Ray Serve LLM's own OpenAI app (`ray.serve.llm.build_openai_app`) serving a model folder on 127.0.0.1:
the serving a Ray user has today (vLLM inside Ray Serve, AR or with a speculative config), as a peer for
`scripts/vllm_peer.sh` (`PEER=serve-llm`). It starts its own local Ray cluster, runs until SIGTERM or
SIGINT, then shuts Serve and Ray down.

    .venv/bin/python -m mars_ray.bench.serve_llm_peer --model DIR --port 8200

Why a peer beside a standalone vLLM server: Ray Serve LLM puts the same hops on a token's way as the
project's replica does (Serve's HTTP proxy, an OpenAI ingress deployment, the engine deployment, vLLM's
engine core process), so it tells the cost of serving vLLM through Ray Serve apart from MARS's.
"""

from __future__ import annotations

import json
import signal
import time

from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args


class ServeLlmPeerConfig(BaseModel):
    """`python -m mars_ray.bench.serve_llm_peer`: the model, where it answers, and vLLM's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="a model folder (the peer loads it as vLLM would)")
    name: str = Field("peer", description="the model name the app serves it as")
    port: int = Field(8200, ge=1024, le=65535, description="Serve's HTTP port on 127.0.0.1")
    dtype: str = Field("bfloat16", description="vLLM's dtype")
    max_model_len: int = Field(2048, ge=16, description="vLLM's context length")
    speculative_config: cli_args.JsonObject | None = Field(
        None, description="vLLM's speculative_config, a JSON object; none: AR decoding"
    )
    num_cpus: int = Field(4, ge=2, description="the CPUs the local Ray cluster declares (reservations)")


def build(config: ServeLlmPeerConfig):
    """The Ray Serve LLM application for `config` (imports Ray Serve LLM only when called)."""
    from ray.serve.llm import LLMConfig, build_openai_app

    engine = {"dtype": config.dtype, "max_model_len": config.max_model_len}
    if config.speculative_config:
        engine["speculative_config"] = json.loads(config.speculative_config)
    llm = LLMConfig(
        model_loading_config={"model_id": config.name, "model_source": config.model},
        accelerator_config={"kind": "cpu"},
        engine_kwargs=engine,
        deployment_config={"num_replicas": 1},
    )
    return build_openai_app({"llm_configs": [llm]})


def main(argv: list[str] | None = None) -> None:
    config = cli_args.parse_command(
        ServeLlmPeerConfig,
        argv,
        prog="python -m mars_ray.bench.serve_llm_peer",
        description=__doc__.split("\n")[0],
    )
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=config.num_cpus, include_dashboard=False, log_to_driver=False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": config.port})
        serve.run(build(config), name="peer", route_prefix="/")
        print(f"serving {config.model} as {config.name} on http://127.0.0.1:{config.port}", flush=True)
        while True:  # short sleeps: a signal that lands on one of Ray's threads runs its handler on wake-up
            time.sleep(1)
    finally:  # vLLM's engine core is a process of the replica's: Serve's shutdown ends it too
        serve.shutdown()
        ray.shutdown()


def _stop(*_) -> None:
    """The first SIGTERM or SIGINT ends the wait; later ones (a `timeout` forwarding its own) are ignored
    while Serve and Ray shut down."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(0)


if __name__ == "__main__":
    main()
