"""Serving configuration: the shipped YAMLs are valid Serve configs whose `args` build the app."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.deployment import Application
from ray.serve.schema import ServeDeploySchema

from mars_ray.serve.app import build_app
from mars_ray.serve.config import AppConfig, ModelConfig

CONFIGS = sorted((Path(__file__).parents[1] / "serve_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_serve_configs_build(path):
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for application in schema.applications:
        assert application.import_path == "mars_ray.serve.app:build_app"
        assert application.runtime_env.get("working_dir") is None  # the installed package is used
        assert isinstance(build_app(application.args), Application)


def test_config_names_and_checks():
    assert ModelConfig(model="tiny").served_name == "tiny"
    assert ModelConfig(model="/runs/quick/mars/final").served_name == "final"
    assert ModelConfig(model="~/runs/x", name="mars-b4").deployment_name == "engine-mars-b4"
    assert ModelConfig(model="Org/Model#1").deployment_name == "engine-Org-Model-1"
    for bad in [
        {"tau": 0},
        {"tau": 1.5},
        {"block_size": 32, "max_block_size": 16},  # beyond max_block_size
        {"max_batch_size": 128},  # beyond max_ongoing_requests
        {"unknown": 1},
    ]:
        with pytest.raises(ValidationError):
            ModelConfig(model="tiny", **bad)
    with pytest.raises(ValidationError, match="unique"):
        AppConfig(models=[{"model": "tiny"}, {"model": "tiny"}])


def test_api_key_from_config_or_environment_and_never_shown(monkeypatch):
    config = AppConfig(models=[{"model": "tiny"}], api_key="sk-secret")
    assert config.api_key.get_secret_value() == "sk-secret"
    assert "sk-secret" not in repr(config) and "sk-secret" not in config.model_dump_json()
    monkeypatch.setenv("MARS_RAY_API_KEY", "sk-from-env")
    assert AppConfig(models=[{"model": "tiny"}]).api_key.get_secret_value() == "sk-from-env"
    monkeypatch.delenv("MARS_RAY_API_KEY")
    assert AppConfig(models=[{"model": "tiny"}]).api_key is None


def serve_args(*argv: str):
    import argparse

    from mars_ray.serve import command

    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return parser, parser.parse_args(["serve", *argv])


def test_mars_ray_serve_has_a_flag_for_every_field_with_its_description():
    from mars_ray.cli_args import flag
    from mars_ray.serve.command import ServerOptions
    from mars_ray.serve.config import TauObjective

    parser, _ = serve_args("--model", "tiny")
    (serve,) = parser._subparsers._group_actions[0].choices.values()
    text = " ".join(serve.format_help().split())
    configs = [
        (ModelConfig, {"tau_control"}),
        (TauObjective, set()),
        (AppConfig, {"models"}),
        (ServerOptions, set()),
    ]
    for config, skip in configs:
        for name, field in config.model_fields.items():
            if name not in skip:
                assert flag(name) in text, name
                assert " ".join(field.description.split()[:4]) in text, name


def test_serve_flags_build_the_app_config_and_turn_the_controller_on():
    from mars_ray.core.errors import ConfigError
    from mars_ray.serve.command import app_config

    plain = app_config(serve_args("--model", "tiny", "--max-batch-size", "48")[1])
    (model,) = plain.models
    assert model.tau_control is None and model.max_batch_size == 48 and model.max_ongoing_requests == 96
    adaptive = app_config(serve_args("--model", "tiny", "--tau-min", "0.8", "--verify-tau", "0.6")[1])
    control = adaptive.models[0].tau_control
    assert control.tau_min == 0.8 and control.verify_tau == 0.6 and control.tau_max == 1.0
    assert app_config(serve_args("--model", "tiny", "--adaptive")[1]).models[0].tau_control.tau_min == 0.7
    keyed = app_config(serve_args("--model", "tiny", "--api-key", "k", "--cors-origins", "http://a")[1])
    assert keyed.api_key.get_secret_value() == "k" and keyed.cors_origins == ["http://a"]
    with pytest.raises(ConfigError) as error:
        app_config(serve_args("--model", "tiny", "--tau-min", "2")[1])
    assert error.value.field == "--tau-min"
    with pytest.raises(ConfigError) as error:
        app_config(serve_args("--model", "tiny", "--max-batch-size", "8", "--max-ongoing-requests", "4")[1])
    assert error.value.field == "ModelConfig"  # a rule across fields names the config it belongs to


def test_compiled_steps_are_the_engines_own_default_unless_asked():
    """vLLM compiles unless told not to (as `vllm serve`); the native engine's minutes of compile are asked
    for. Every reader asks `compiled`, so the rule lives in one place."""
    assert ModelConfig(model="tiny", engine="vllm").compiled
    assert not ModelConfig(model="tiny").compiled
    assert not ModelConfig(model="tiny", engine="vllm", compile=False).compiled
    assert ModelConfig(model="tiny", compile=True).compiled
