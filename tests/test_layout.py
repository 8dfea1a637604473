"""The runtime does not depend on the benchmarks: nothing under `mars_ray/core`, `mars_ray/serve` or
`mars_ray/train` imports `mars_ray.bench`, at module level or lazily inside a function, so a benchmark can
change without touching what is served or trained."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mars_ray"
RUNTIME = ("core", "serve", "train")
BENCH = "mars_ray.bench"


def bench_imports(source: str, module: str, target: str = BENCH) -> list[str]:
    """The imports of `target` (default `mars_ray.bench`, or anything in it) in `source`, the text of
    `module`: every `import`/`from ... import` node anywhere in the tree, relative ones resolved against
    `module`."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            origin = ".".join(part for part in (base, node.module or "") if part)
            names = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [
            f"line {node.lineno}: {name}" for name in names if name == target or name.startswith(target + ".")
        ]
    return found


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("import mars_ray.bench.client\n", "mars_ray.serve.app"),
        ("from mars_ray import bench\n", "mars_ray.serve.app"),
        ("def later():\n    from mars_ray.bench.client import percentile\n", "mars_ray.train.run"),
        ("from ..bench import loadtest\n", "mars_ray.core.decoding"),
        ("from .. import bench\n", "mars_ray.core.decoding"),
    ],
)
def test_the_check_sees_every_form_of_import(source, module):
    assert bench_imports(source, module)


def test_the_check_passes_what_is_not_the_bench():
    source = "import mars_ray.benchmarks\nfrom mars_ray.serve import engine\nfrom . import bench\n"
    assert not bench_imports(source, "mars_ray.serve.app")  # `.bench` here would be mars_ray.serve.bench


def test_the_runtime_never_imports_the_bench():
    files = [path for part in RUNTIME for path in sorted((PACKAGE / part).rglob("*.py"))]
    assert len(files) > 10  # the folders are where this test thinks they are
    offenders = {}
    for path in files:
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if found := bench_imports(path.read_text(), module):
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert not offenders, f"the runtime imports the benchmarks: {offenders}"


# The edges stay at the edges: the core is torch + transformers only; the vLLM plugin, loaded inside vLLM's
# worker processes, brings neither Ray nor the training or serving code.
EDGES = [
    ("core", ["ray", "vllm", "mars_ray.serve", "mars_ray.train", "mars_ray.vllm"]),
    ("vllm", ["ray", "mars_ray.serve", "mars_ray.train", "mars_ray.bench"]),
]


@pytest.mark.parametrize(("part", "forbidden"), EDGES)
def test_each_edge_imports_only_what_it_may(part, forbidden):
    files = sorted((PACKAGE / part).rglob("*.py"))
    assert files
    offenders = {}
    for path in files:
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found = [hit for target in forbidden for hit in bench_imports(path.read_text(), module, target)]
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert not offenders, f"{part} imports what it must not: {offenders}"
