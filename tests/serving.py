"""What the Serve tests share: a free port on 127.0.0.1, and an app of theirs on a local Ray of its own."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator


def free_port(start: int) -> int:
    """The first port from `start` that nothing listens on."""
    for port in range(start, start + 50):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError("no free port")


@contextlib.contextmanager
def local_app(app_config: dict, port: int, route_prefix: str = "/", **ray_options) -> Iterator[str]:
    """Start a Ray cluster of its own (2 CPUs), Serve on 127.0.0.1 from the first free port at or after
    `port`, and `build_app(app_config)` on it under `route_prefix`; yield the server's URL (the prefix not
    in it), and shut both down after."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from mars_ray.serve.app import build_app

    port = free_port(port)
    options = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False, **ray_options}
    ray.init(address="local", **options)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_config), name="mars", route_prefix=route_prefix)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
