"""What a mars-ray replica asks of vLLM's worker at run time: the engine's operating point.

vLLM mixes this class into its worker (`worker_extension_cls`, set for every MARS checkpoint by
`mars_engine_args`), and the replica calls it through `AsyncLLM.collective_rpc` whenever its tau controller
or `serve deploy` moves the point. Requests that follow the point (`follow` in their fields) decode at the
new one from their next forward, as the native engine's running requests do.
"""

from __future__ import annotations

from mars_ray.vllm.proposer import MarsProposer

OPERATING_POINT_RPC = "mars_operating_point"


class MarsWorker:
    """vLLM's worker, extended by the one call a replica makes."""

    def mars_operating_point(self, tau: float, verify: bool, block_size: int) -> bool:
        """Set the MARS proposer's operating point; False where this worker drafts with no MARS proposer."""
        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, MarsProposer):
            return False
        drafter.follow(tau, verify, block_size)
        return True
