"""`mars-ray serve`: one model behind the OpenAI API, the simple case of the YAMLs in `serve_configs/`."""

from __future__ import annotations

import argparse
import signal
import time

from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args, models
from mars_ray.serve.config import AppConfig, ModelConfig, TauObjective


class ServerOptions(BaseModel):
    """Where the HTTP server listens, and the Ray cluster it runs on (a Serve YAML sets these itself)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address the HTTP server binds")
    port: int = Field(8000, description="port of the HTTP server")
    ray_address: str | None = Field(
        None, description="Ray cluster to use ('local': a new one; None: a running one, else a new local one)"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over the OpenAI API (Ray Serve)",
        description="One model behind the OpenAI API. Every field of the serving config is a flag: the"
        " model's (ModelConfig), the load-adaptive tau controller's (TauObjective: any of its flags, or"
        " --adaptive, turns it on) and the app's (AppConfig).",
    )
    cli_args.add_config_arguments(
        parser.add_argument_group("model (ModelConfig)"), ModelConfig, exclude=frozenset({"tau_control"})
    )
    adaptive = parser.add_argument_group("load-adaptive tau (TauObjective)")
    adaptive.add_argument("--adaptive", action="store_true", help="turn the tau controller on (its defaults)")
    cli_args.add_config_arguments(adaptive, TauObjective)
    cli_args.add_config_arguments(
        parser.add_argument_group("app (AppConfig)"), AppConfig, exclude=frozenset({"models"})
    )
    cli_args.add_config_arguments(parser.add_argument_group("server (ServerOptions)"), ServerOptions)
    parser.set_defaults(run=run)


def app_config(args: argparse.Namespace) -> AppConfig:
    """The app the flags describe: one model, the controller if any of its flags (or --adaptive) is given."""
    control = cli_args.given(TauObjective, args)
    tau_control = None
    if control or args.adaptive:
        tau_control = cli_args.config_from_args(TauObjective, args)
    model_values = cli_args.given(ModelConfig, args)
    if "max_ongoing_requests" not in model_values:  # room for a full batch plus as many waiting
        model_values["max_ongoing_requests"] = max(64, 2 * model_values.get("max_batch_size", 32))
    model = cli_args.validated(ModelConfig, {**model_values, "tau_control": tau_control}, name=cli_args.flag)
    return cli_args.config_from_args(AppConfig, args, models=[model])


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> None:
    app, server = app_config(args), cli_args.config_from_args(ServerOptions, args)
    (model,) = app.models
    models.resolve(model.model)  # a missing folder fails here, not in a replica that Serve keeps restarting
    import ray
    from ray import serve

    from mars_ray.serve.app import build_app

    ray.init(address=server.ray_address)
    # Ctrl-C and SIGTERM (what Kubernetes and `kill` send) both stop cleanly, even where the shell that
    # started this left SIGINT ignored, as a script's background job does.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(build_app(app), name="mars", route_prefix="/")
        url = f"http://{server.host}:{server.port}/v1"
        print(f"serving {model.served_name!r} at {url} (Ctrl-C stops)", flush=True)
        while True:
            # Short sleeps: a signal may land on one of Ray's threads, and Python runs the handler only
            # when the main thread next wakes up.
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete("mars")
        ray.shutdown()
