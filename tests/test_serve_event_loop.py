"""Every method Serve calls on our deployments runs on the replica's event loop.

Ray 2.60 runs a deployment's sync methods in a thread pool (RAY_SERVE_RUN_SYNC_IN_THREADPOOL), where they
race the event loop: `stats` read and trimmed the deques the decode loop appends to, `reconfigure` moved the
operating point while the controller's tick did, `StatusBoard.snapshot` iterated the dict `post` grows. Async
methods run one at a time on the loop, between its steps.
"""

from __future__ import annotations

import inspect

from ray.serve._private.constants import RAY_SERVE_RUN_SYNC_IN_THREADPOOL

from mars_ray.serve.replica import EngineDeployment
from mars_ray.serve.status_board import StatusBoard


def test_deployment_methods_are_async():
    assert RAY_SERVE_RUN_SYNC_IN_THREADPOOL  # why: a sync method would run in another thread
    for deployment in (EngineDeployment, StatusBoard):
        cls = deployment.func_or_class
        public = {
            name: f for name, f in vars(cls).items() if inspect.isfunction(f) and not name.startswith("_")
        }
        assert {"stats", "reconfigure", "snapshot", "post"} & set(public)
        sync = [
            name
            for name, f in public.items()
            if not (inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f))
        ]
        assert sync == [], f"{cls.__name__}: {sync} would run in Serve's thread pool"
