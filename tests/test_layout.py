"""The architecture's guard. The runtime does not depend on the benchmarks: nothing under `mars_ray/core`,
`mars_ray/serve` or `mars_ray/train` imports `mars_ray.bench`, at module level or lazily inside a function,
so a benchmark can change without touching what is served or trained. The core is torch + transformers
only; the reference decoders stay out of what is served or trained; every room stays small enough to read
(modules under 400 lines, classes under 250)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mars_ray"
RUNTIME = ("core", "serve", "train")
BENCH = "mars_ray.bench"


def imported(source: str, module: str) -> list[tuple[int, str]]:
    """Every name `source` (the text of `module`) imports, with its line: every `import`/`from ... import`
    node anywhere in the tree, relative ones resolved against `module` (`from a import b` gives `a` and
    `a.b`)."""
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
        found += [(node.lineno, name) for name in names]
    return found


def bench_imports(source: str, module: str, target: str = BENCH) -> list[str]:
    """The imports of `target` (default `mars_ray.bench`, or anything in it) in `source`, the text of
    `module`."""
    return [
        f"line {line}: {name}"
        for line, name in imported(source, module)
        if name == target or name.startswith(target + ".")
    ]


def modules(part: str = "") -> list[tuple[Path, str]]:
    """The files under `mars_ray/<part>` (the whole package by default), each with its module name."""
    files = sorted((PACKAGE / part).rglob("*.py"))
    assert files  # the folder is where this test thinks it is
    return [(path, ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)) for path in files]


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("import mars_ray.bench.client\n", "mars_ray.serve.app"),
        ("from mars_ray import bench\n", "mars_ray.serve.app"),
        ("def later():\n    from mars_ray.bench.client import percentile\n", "mars_ray.train.run"),
        ("from ..bench import loadtest\n", "mars_ray.core.decoder"),
        ("from .. import bench\n", "mars_ray.core.decoder"),
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


# The core's own dependencies: the standard library, torch and the Hugging Face stack it loads weights with.
CORE_MAY_IMPORT = {"torch", "transformers", "safetensors", "__future__"} | set(sys.stdlib_module_names)


def test_the_core_is_torch_and_transformers_only():
    """Nothing under `mars_ray/core` imports a third-party package beyond torch and transformers (no Ray, no
    vLLM, no FastAPI, no pydantic) or any of mars_ray outside the core: everything else builds on it."""
    offenders = {}
    for path, module in modules("core"):
        found = [
            f"line {line}: {name}"
            for line, name in imported(path.read_text(), module)
            if not (name.split(".")[0] in CORE_MAY_IMPORT or name == "mars_ray.core")
            and not name.startswith("mars_ray.core.")
        ]
        if found:
            offenders[path.name] = found
    assert not offenders, f"the core imports beyond torch and transformers: {offenders}"


def test_the_decoding_monolith_does_not_come_back():
    """The decoder is split by role (config, state, sampling, KV cache, decoder, admission, reference): no
    module named `decoding` exists, and nothing imports one."""
    assert not [path for path, _ in modules() if path.stem == "decoding" or path.parent.name == "decoding"]
    for root in (
        PACKAGE,
        PACKAGE.parent / "tests",
        PACKAGE.parent / "scripts",
        PACKAGE.parent / "benchmarks",
    ):
        for path in sorted(root.rglob("*.py")) if root.exists() else []:
            module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
            assert not bench_imports(path.read_text(), module, "mars_ray.core.decoding"), path


# The reference decoders (`mars_ray.core.reference`) check and benchmark the production decoder; nothing
# served or trained, and not the production decoder itself, may come to depend on them.
REFERENCE = "mars_ray.core.reference"


@pytest.mark.parametrize("part", ["serve", "train", "core/decoder.py", "core/admission.py"])
def test_nothing_served_or_trained_runs_the_reference_decoders(part):
    files = [PACKAGE / part] if part.endswith(".py") else [path for path, _ in modules(part)]
    offenders = {}
    for path in files:
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if found := bench_imports(path.read_text(), module, REFERENCE):
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert not offenders, f"the reference decoders are imported by: {offenders}"


MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 250


def test_every_room_is_small_enough_to_read():
    """No module of the package over 400 lines, no class over 250: a room holds one job."""
    too_long = {}
    for path, _ in modules():
        source = path.read_text()
        if (lines := source.count("\n")) > MAX_MODULE_LINES:
            too_long[str(path.relative_to(PACKAGE.parent))] = f"{lines} lines"
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.ClassDef)
                and (size := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES
            ):
                too_long[f"{path.relative_to(PACKAGE.parent)}::{node.name}"] = f"{size} lines"
    assert not too_long, f"split these by role: {too_long}"


# Each rule has one home; a second copy of it is how rules start to disagree (a pattern, the one file it
# may appear in under mars_ray/).
ONE_HOME = [
    (r'"verify" if ', "core/decode_config.py"),  # the mode label
    (r'Literal\["auto", "float32"', "core/dtypes.py"),  # the dtype names
    (r"^MEGABATCH =|1_000_003", "train/batching.py"),  # the shuffle's megabatch and its seed
    (r"os\.replace\(", "folders.py"),  # publishing a file or folder whole
    (r"class \w*Error\(ValueError\)", "core/errors.py"),  # the one error type (carrying its field)
    (r"^\s*(from|import) ray\.(_private|\w+\._internal)", None),  # no private Ray module
]


@pytest.mark.parametrize(("pattern", "home"), ONE_HOME)
def test_each_rule_has_one_home(pattern, home):
    found = sorted(
        str(path.relative_to(PACKAGE))
        for path, _ in modules()
        if re.search(pattern, path.read_text(), re.MULTILINE)
    )
    assert found == ([home] if home else []), f"{pattern!r} belongs in {home} only, found in {found}"
