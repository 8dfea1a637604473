"""The replica talks to either engine through one protocol (`ServingEngine`): both engines have each of its
members (methods with its parameters, sync or async as it says), and the replica uses nothing else."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from mars_ray.serve import replica
from mars_ray.serve.engine import Engine
from mars_ray.serve.protocol import ServingEngine
from mars_ray.serve.vllm_engine import VllmEngine

MEMBERS = {name for name in vars(ServingEngine) if not name.startswith("_")} | set(
    ServingEngine.__annotations__
)


def annotated(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})}


def kind(function) -> str:
    if inspect.isasyncgenfunction(function):
        return "async iterator"
    return "coroutine" if inspect.iscoroutinefunction(function) else "plain"


@pytest.mark.parametrize("engine", [Engine, VllmEngine])
def test_each_engine_has_every_member_of_the_protocol(engine):
    assert {"generate", "load", "max_context", "tokenizer", "tau"} <= MEMBERS  # the protocol is read here
    for name in sorted(MEMBERS):
        assert hasattr(engine, name) or name in annotated(engine), f"{engine.__name__} lacks {name}"
        wanted = inspect.getattr_static(ServingEngine, name, None)
        if not (inspect.isfunction(wanted) or isinstance(wanted, classmethod)):
            continue
        ours, theirs = getattr(ServingEngine, name), getattr(engine, name)
        assert list(inspect.signature(theirs).parameters) == list(inspect.signature(ours).parameters), name
        # `generate` is declared as a plain method returning an async iterator; an async generator is one.
        expected = "async iterator" if name == "generate" else kind(ours)
        assert kind(theirs) == expected, f"{engine.__name__}.{name}"


def test_the_replica_uses_only_the_protocol():
    used = set(re.findall(r"self\.engine\.(\w+)", Path(replica.__file__).read_text()))
    assert used and used <= MEMBERS, used - MEMBERS
