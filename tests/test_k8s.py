"""The KubeRay manifests in k8s/: valid for the CRDs (strictly), generated from the configs the local commands
use (serve_configs/, README.md), and consistent with the Dockerfile and the project's pins."""

from __future__ import annotations

import gzip
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path
from types import ModuleType

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
MANIFESTS = ["pvc.yaml", "raycluster.yaml", "rayjob-train.yaml", "rayjob-train-gpu.yaml", "rayservice.yaml"]


def _script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


validate = _script(K8S / "validate.py")
render = _script(K8S / "render.py")
extract = _script(K8S / "crds" / "extract.py")


def manifest(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


CLUSTERS = {  # where each manifest holds its RayCluster spec
    "raycluster.yaml": ["spec"],
    "rayjob-train.yaml": ["spec", "rayClusterSpec"],
    "rayjob-train-gpu.yaml": ["spec", "rayClusterSpec"],
    "rayservice.yaml": ["spec", "rayClusterConfig"],
}


def cluster_spec(name: str) -> dict:
    spec = manifest(name)
    for key in CLUSTERS[name]:
        spec = spec[key]
    return spec


def pod_specs(cluster: dict) -> list[dict]:
    return [cluster["headGroupSpec"]["template"]["spec"]] + [
        group["template"]["spec"] for group in cluster["workerGroupSpecs"]
    ]


# --- every manifest is valid for its CRD, strictly ---------------------------------------------------------


def test_k8s_holds_the_expected_manifests():
    assert sorted(path.name for path in K8S.glob("*.yaml")) == sorted(MANIFESTS)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_is_valid_for_its_crd(name):
    assert validate.file_errors(K8S / name) == []


def _container(document: dict) -> dict:
    return document["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]


UNKNOWN_FIELDS = {
    # a misspelt key inside a pod template: the open CRD schema lets it through
    "container": lambda d: _container(d).update(imagePullPolicyy="Always"),
    # v1alpha1's name of serveConfigV2
    "spec": lambda d: d["spec"].update(serveConfig="applications: []"),
    "cluster": lambda d: d["spec"]["rayClusterConfig"].update(enableInTreeAutoScaling=True),
    "metadata": lambda d: d["metadata"].update(lables={"app": "mars"}),
    "status": lambda d: d.update(status={"serviceStatus": "Running"}),
}


@pytest.mark.parametrize("where", UNKNOWN_FIELDS)
def test_unknown_field_is_rejected(where):
    document = manifest("rayservice.yaml")
    UNKNOWN_FIELDS[where](document)
    jsonschema.Draft4Validator(validate.crd_schema("RayService")).validate(document)  # open: passes
    (error,) = validate.errors(document)
    assert "Additional properties are not allowed" in error


MISTYPED_FIELDS = {
    "rayStartParams value": lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update(
        {"num-cpus": 0}
    ),
    "replicas": lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replicas="1"),
    "boolean": lambda d: d["spec"]["rayClusterConfig"].update(enableInTreeAutoscaling="true"),
    "serveConfigV2 as a mapping": lambda d: d["spec"].update(serveConfigV2={"applications": []}),
    # an API server answers "must be of type integer,string" to a float quantity: write "1500m" or "1.5"
    "quantity": lambda d: _container(d)["resources"]["limits"].update(cpu=1.5),
}


@pytest.mark.parametrize("what", MISTYPED_FIELDS)
def test_mistyped_field_is_rejected(what):
    document = manifest("rayservice.yaml")
    MISTYPED_FIELDS[what](document)
    (error,) = validate.errors(document)
    assert "is not of type" in error or "is not valid under any of the given schemas" in error


@pytest.mark.parametrize("cpu", [4, "4", "500m"])
def test_int_or_string_takes_both(cpu):
    document = manifest("rayservice.yaml")
    _container(document)["resources"]["limits"]["cpu"] = cpu
    assert validate.errors(document) == []


def test_strict_reads_kubernetes_extensions():
    schema = validate.strict(
        {
            "type": "object",
            "properties": {
                "open": {
                    "type": "object",
                    "properties": {"a": {}},
                    "x-kubernetes-preserve-unknown-fields": True,
                },
                "port": {"x-kubernetes-int-or-string": True},
                "time": {"type": "string", "nullable": True},
            },
        }
    )
    check = jsonschema.Draft4Validator(schema).is_valid
    assert check({"open": {"a": 1, "b": 2}, "port": 8000, "time": None}) and check({"port": "http"})
    assert not check({"port": 80.5}) and not check({"time": 3}) and not check({"other": 1})


def test_persistent_volume_claim_is_checked_too():
    claim = manifest("pvc.yaml")
    claim["spec"]["accessMode"] = claim["spec"].pop("accessModes")
    (error,) = validate.errors(claim)
    assert "'accessMode' was unexpected" in error


def test_unknown_kind_or_version_is_rejected():
    job = manifest("rayjob-train.yaml")
    assert "no schema for kind 'Deployment'" in validate.errors({**job, "kind": "Deployment"})[0]
    assert validate.errors({**job, "apiVersion": "ray.io/v1alpha1"}) == [
        "apiVersion: 'ray.io/v1alpha1' is not one of ['ray.io/v1']"
    ]


SHARED_CRDS = extract.DEFAULT_SOURCE


@pytest.mark.skipif(not SHARED_CRDS.is_dir(), reason=f"{SHARED_CRDS} is not beside this checkout")
@pytest.mark.parametrize("kind", extract.CRD_FILES)
def test_vendored_schema_is_the_shared_crds(kind):
    crd = extract.load_crd(SHARED_CRDS / extract.CRD_FILES[kind])
    vendored = (K8S / "crds" / f"{kind}.json.gz").read_bytes()
    assert gzip.decompress(extract.encode(extract.v1_schema(crd))) == gzip.decompress(vendored)


# --- one source of truth: serve_configs/ and README.md ---------------------------------------------------


def test_manifests_are_rendered_from_their_sources():
    expected = render.rendered(render.README.read_text(), render.SERVE_CONFIG.read_text())
    stale = [path.name for path, text in expected.items() if path.read_text() != text]
    assert not stale, f"stale {stale}: run `python k8s/render.py`"


def test_serve_config_v2_is_a_ray_serve_deploy_config_equal_to_serve_configs():
    embedded = yaml.safe_load(manifest("rayservice.yaml")["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    assert embedded == yaml.safe_load(render.SERVE_CONFIG.read_text())


def test_serve_proxies_are_where_kuberay_sends_traffic():
    """KubeRay's Service targets the pods' IPs, and a worker pod is ready only once its own proxy answers."""
    embedded = yaml.safe_load(manifest("rayservice.yaml")["spec"]["serveConfigV2"])
    config = ServeDeploySchema.model_validate(embedded)
    assert config.http_options.host not in ("127.0.0.1", "localhost", "::1")
    assert config.proxy_location == "EveryNode"


def test_rayservice_can_add_replicas_and_nodes():
    cluster = manifest("rayservice.yaml")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert any(group["maxReplicas"] > group["minReplicas"] for group in cluster["workerGroupSpecs"])


def test_rayjob_entrypoint_is_the_readme_train_command():
    command = render.train_command(render.README.read_text())
    assert shlex.split(manifest("rayjob-train.yaml")["spec"]["entrypoint"]) == command
    gpu = command + ["use_gpu=true", "strategy=fsdp"]
    assert shlex.split(manifest("rayjob-train-gpu.yaml")["spec"]["entrypoint"]) == gpu
    from mars_ray.train.config import load_config  # the overrides the GPU job adds are valid keys and values

    config = load_config(REPO / command[command.index("--config") + 1], gpu[command.index("--config") + 2 :])
    assert config.use_gpu and config.strategy == "fsdp"


def test_train_command_reads_the_first_submit_in_the_train_section():
    readme = """# x
## Serve
```bash
ray job submit -- python other.py
```
## Train
Start a cluster, then:
```bash
$ RAY_AUTH_MODE=token .venv/bin/ray job submit --working-dir . \\
    -- python jobs/train_mars.py --config 'configs/my run.yaml' steps=10  # a comment
ray job submit -- python second.py
```
### Details
## Evaluate
"""
    assert render.train_command(readme) == [
        "python",
        "jobs/train_mars.py",
        "--config",
        "configs/my run.yaml",
        "steps=10",
    ]


@pytest.mark.parametrize(
    "readme, message",
    [
        ("# x\n## Serve\n", "no `## Train` section"),
        ("## Train\n```\nray start --head\n```\n", "no `ray job submit"),
        ("## Train\n```\nray job submit python train.py\n```\n", "no `--`"),
    ],
)
def test_train_command_missing_is_an_error(readme, message):
    with pytest.raises(ValueError, match=message):
        render.train_command(readme)


def test_set_serve_config_replaces_the_whole_block():
    before = "spec:\n  serveConfigV2: |\n    old: 1\n\n    older: 2\n  rayClusterConfig: {}\n"
    after = render.set_serve_config(before, "# comment\napplications:\n  - name: a\n\n")
    block = "    # comment\n    applications:\n      - name: a\n"
    assert after == "spec:\n  serveConfigV2: |\n" + block + "  rayClusterConfig: {}\n"


# --- the manifests agree with the Dockerfile and the project's pins ---------------------------------------


def _pins() -> dict[str, str]:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return dict(re.fullmatch(r"([\w-]+)(?:\[.*\])?==(.+)", d).groups() for d in dependencies)


def test_dockerfile_installs_like_setup_sh():
    dockerfile = (REPO / "Dockerfile").read_text()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    pins = _pins()
    assert re.search(r"^FROM rayproject/ray:([\d.]+)-py311-", dockerfile, re.M).group(1) == pins["ray"]
    assert re.search(r"torch==([\w.]+)\s*$", dockerfile, re.M).group(1) == pins["torch"]
    assert "--no-deps" in setup
    no_deps = re.compile(r"--no-deps (.+?)\s*$", re.M)
    assert no_deps.search(dockerfile).group(1) == no_deps.search(setup).group(1)
    assert '-e ".[test]"' in dockerfile and '-e ".[test]"' in setup


@pytest.mark.parametrize("name", ["rayjob-train.yaml", "rayjob-train-gpu.yaml"])
def test_rayjob_working_dir_is_the_image_checkout(name):
    workdir = re.search(r"^WORKDIR (\S+)", (REPO / "Dockerfile").read_text(), re.M).group(1)
    assert yaml.safe_load(manifest(name)["spec"]["runtimeEnvYAML"]) == {"working_dir": workdir}


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_runs_one_ray_version_and_image(name):
    cluster = cluster_spec(name)
    assert cluster["rayVersion"] == _pins()["ray"]
    images = {container["image"] for pod in pod_specs(cluster) for container in pod["containers"]}
    assert len(images) == 1, images


@pytest.mark.parametrize("name", CLUSTERS)
def test_every_ray_pod_has_the_shared_home(name):
    claim = manifest("pvc.yaml")["metadata"]["name"]
    for pod in pod_specs(cluster_spec(name)):
        volumes = {
            v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim
        }
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            mounts = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in volumes}
            assert env["MARS_RAY_HOME"] in mounts


def test_gpu_variant_asks_for_gpus():
    cluster = cluster_spec("rayjob-train-gpu.yaml")
    (worker,) = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["image"].endswith("-gpu")
