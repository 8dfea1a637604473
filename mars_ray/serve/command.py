"""`mars-ray serve`: one model behind the OpenAI API, the simple case of the YAMLs in `serve_configs/`."""

from __future__ import annotations

import argparse
import signal
import time

from mars_ray import models
from mars_ray.serve.config import AppConfig, ModelConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over the OpenAI API (Ray Serve)")
    parser.add_argument(
        "--model", required=True, help="local HF folder, Hub id, or preset (tiny, smollm2-135m)"
    )
    parser.add_argument("--name", help="model name clients ask for (default: derived from --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tau", type=float, default=1.0, help="operating tau for requests without their own")
    parser.add_argument(
        "--block-size", type=int, help="window for requests without their own (default: the trained B)"
    )
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--num-replicas", type=int, default=1)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs reserved per replica")
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $MARS_RAY_API_KEY; neither: open)",
    )
    parser.add_argument("--cors-origin", action="append", default=[], help="a browser origin allowed (CORS)")
    parser.add_argument(
        "--ray-address",
        help="Ray cluster to use (default: a running one, else a new local one; 'local': new)",
    )
    parser.set_defaults(run=run)


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> None:
    model = ModelConfig(
        model=args.model,
        name=args.name,
        tau=args.tau,
        block_size=args.block_size,
        max_batch_size=args.max_batch_size,
        max_ongoing_requests=max(64, 2 * args.max_batch_size),
        num_replicas=args.num_replicas,
        num_cpus=args.num_cpus,
    )
    models.resolve(args.model)  # a missing folder fails here, not in a replica that Serve keeps restarting
    import ray
    from ray import serve

    from mars_ray.serve.app import build_app

    ray.init(address=args.ray_address)
    # Ctrl-C and SIGTERM (what Kubernetes and `kill` send) both stop cleanly, even where the shell that
    # started this left SIGINT ignored, as a script's background job does.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = AppConfig(models=[model], api_key=args.api_key, cors_origins=args.cors_origin)
        serve.run(build_app(app), name="mars", route_prefix="/")
        print(
            f"serving {model.served_name!r} at http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True
        )
        while True:
            # Short sleeps: a signal may land on one of Ray's threads, and Python runs the handler only
            # when the main thread next wakes up.
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete("mars")
        ray.shutdown()
