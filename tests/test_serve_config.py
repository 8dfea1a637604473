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
