"""MARS behind Ray Serve LLM itself: `build_openai_app` with `LLMConfig(engine_kwargs={"speculative_config":
speculative_config(dir)})`, on a real Ray cluster on 127.0.0.1, answers the official `openai` client with
vLLM AR's replies, a request's tau set through vLLM's `vllm_xargs`.
"""

from __future__ import annotations

import os

import openai
import pytest
from serving import free_port
from test_vllm_mars import write_checkpoint

from mars_ray.vllm import speculative_config

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

MESSAGES = [[{"role": "user", "content": f"Count from {i} to {i + 6}."}] for i in range(4)]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    checkpoint = write_checkpoint("llama", tmp_path_factory.mktemp("serve-llm"))

    def config(name: str, mars: bool) -> LLMConfig:
        engine = dict(dtype="float32", max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=1 << 30)
        if mars:
            engine["speculative_config"] = speculative_config(checkpoint)
            engine["per_request_spec_decode_metrics"] = "summary"  # a reply's `metrics.speculative_decoding`
        return LLMConfig(
            model_loading_config=dict(model_id=name, model_source=checkpoint),
            accelerator_config={"kind": "cpu"},
            engine_kwargs=engine,
            deployment_config=dict(ray_actor_options={"num_cpus": 0.5}),
        )

    port = free_port(8660)
    # Logical CPUs for Ray's accounting: each LLM deployment also reserves a placement group for its engine.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(LLMServingArgs(llm_configs=[config("ar", False), config("mars", True)])))
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_ray_serve_llm_replies_equal_vllm_ar_at_any_tau(client):
    accepted = 0
    for messages in MESSAGES:
        ar = client.chat.completions.create(model="ar", messages=messages, max_tokens=32, temperature=0)
        for tau in (0.9, 0.5):
            mars = client.chat.completions.create(
                model="mars",
                messages=messages,
                max_tokens=32,
                temperature=0,
                extra_body={"vllm_xargs": {"tau": tau}},
            )
            assert mars.choices[0].message.content == ar.choices[0].message.content
            metrics = (mars.model_extra or {}).get("metrics") or {}
            accepted += (metrics.get("speculative_decoding") or {}).get("num_accepted_draft_tokens", 0)
    assert accepted > 0  # the masks' proposals were carried and some held
