"""MARS inside vLLM: the model's own mask-slot predictions as speculative drafts, checked by vLLM itself.

A user writes one line, `speculative_config=mars_ray.vllm.speculative_config(model_dir)`, and vLLM (or Ray
Serve LLM, which is vLLM inside) decodes a MARS checkpoint several tokens per forward, greedy text exactly
vLLM's own. `proposer.MarsProposer` is the drafter vLLM loads (`method: custom_class`); `acceptance` reads
the mask rows' logits in the same forward and applies the per-request rule. Import-light: vLLM is imported
only by the modules vLLM itself loads, in its worker process.
"""

from mars_ray.vllm.config import speculative_config

__all__ = ["speculative_config"]
