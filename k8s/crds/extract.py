"""Re-extracts the vendored CRD schemas from the KubeRay CRD files (default: ../shared/kuberay-crds/).

    python k8s/crds/extract.py [CRD_DIR]

For each of RayCluster, RayJob and RayService it keeps only the `openAPIV3Schema` of the `v1` version (the
served, storage version) and writes it as `<kind>.json.gz`: sorted, compact JSON, gzipped without a
timestamp, so re-extracting unchanged CRDs leaves the files byte for byte the same.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = HERE.parents[2] / "shared" / "kuberay-crds"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}


def load_crd(path: Path) -> dict:
    """A CRD file, parsed with libyaml where PyYAML has it (the files are about 1 MB each)."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def v1_schema(crd: dict) -> dict:
    """The `openAPIV3Schema` of a CRD's `v1` version, which must be served and the storage version."""
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    if not (version["served"] and version["storage"]):
        raise ValueError(f"{crd['metadata']['name']}: v1 is not the served storage version")
    return version["schema"]["openAPIV3Schema"]


def encode(schema: dict) -> bytes:
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    return gzip.compress(text.encode(), mtime=0)


def main(argv: list[str]) -> None:
    source = Path(argv[0]) if argv else DEFAULT_SOURCE
    for kind, name in CRD_FILES.items():
        crd = load_crd(source / name)
        if crd["spec"]["names"]["kind"] != kind:
            raise ValueError(f"{name}: expected kind {kind}, found {crd['spec']['names']['kind']}")
        target = HERE / f"{kind}.json.gz"
        target.write_bytes(encode(v1_schema(crd)))
        print(f"{source / name} -> {target.relative_to(HERE.parents[1])}")


if __name__ == "__main__":
    main(sys.argv[1:])
