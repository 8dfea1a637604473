"""Validates the manifests in k8s/ against KubeRay's CRD schemas (vendored in k8s/crds/), strictly.

    python k8s/validate.py [FILE ...]    # default: every k8s/*.yaml; exit status 1 if any is invalid

A CRD's `openAPIV3Schema` leaves its objects open: JSON Schema lets unknown keys through, and it is the API
server that rejects them (kubectl's default strict field validation). `strict` closes every object that
declares `properties`, so a misspelt or misplaced field fails here as it would there. Kubernetes' own
extensions are read as the server reads them: `x-kubernetes-int-or-string` (an integer or a string, such as
a CPU quantity), `nullable`, `x-kubernetes-preserve-unknown-fields` (left open).
Not checked here: CEL rules (`x-kubernetes-validations`), list-map key uniqueness, string formats.

Kinds: RayCluster, RayJob, RayService (the CRDs, `ray.io/v1`) and PersistentVolumeClaim, whose `spec` is
checked against the PersistentVolumeClaimSpec schema the RayCluster CRD embeds for ephemeral volumes (the
core v1 type, copied into the CRD). Top-level `metadata` is checked against the part of ObjectMeta that
hand-written manifests use: name, namespace, labels, annotations.
"""

from __future__ import annotations

import gzip
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

K8S = Path(__file__).resolve().parent
CRD_KINDS = ("RayCluster", "RayJob", "RayService")
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
        "namespace": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}
# Where the RayCluster CRD embeds the core v1 PersistentVolumeClaimSpec.
PVC_SPEC_PATH = "spec headGroupSpec template spec volumes [] ephemeral volumeClaimTemplate spec".split()


def strict(schema: Any) -> Any:
    """A copy of a CRD schema in which objects that declare `properties` reject any other key."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    if "properties" in schema:
        closed["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            closed["additionalProperties"] = False
    for keyword in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(keyword), dict):
            closed[keyword] = strict(schema[keyword])
    for keyword in ("anyOf", "allOf", "oneOf"):
        if keyword in schema:
            closed[keyword] = [strict(sub) for sub in schema[keyword]]
    if schema.get("x-kubernetes-int-or-string"):
        closed.pop("type", None)
        closed["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in schema:
        closed["type"] = [schema["type"], "null"]
    return closed


def crd_schema(kind: str) -> dict:
    """The vendored `openAPIV3Schema` of a KubeRay CRD, as the API server has it (open objects)."""
    return json.loads(gzip.decompress((K8S / "crds" / f"{kind}.json.gz").read_bytes()))


def _descend(schema: dict, path: list[str]) -> dict:
    for step in path:
        schema = schema["items"] if step == "[]" else schema["properties"][step]
    return schema


def _document_schema(api_version: str, kind: str, spec: dict) -> dict:
    """A whole manifest: the CRD's own root is replaced to fix apiVersion and kind and to forbid `status`."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"enum": [api_version]},
            "kind": {"enum": [kind]},
            "metadata": OBJECT_META,
            "spec": spec,
        },
    }


@cache
def strict_schema(kind: str) -> dict:
    """The closed schema a whole manifest of `kind` is validated against."""
    if kind in CRD_KINDS:
        return strict(_document_schema("ray.io/v1", kind, crd_schema(kind)["properties"]["spec"]))
    if kind == "PersistentVolumeClaim":
        return strict(_document_schema("v1", kind, _descend(crd_schema("RayCluster"), PVC_SPEC_PATH)))
    raise KeyError(kind)


def errors(document: Any) -> list[str]:
    """What is wrong with one manifest document, one line per problem; empty when it is valid."""
    if not isinstance(document, dict):
        return [f"a manifest must be a mapping, not {type(document).__name__}"]
    kind = document.get("kind")
    try:
        schema = strict_schema(kind)
    except KeyError:
        return [
            f"no schema for kind {kind!r}: expected one of {', '.join((*CRD_KINDS, 'PersistentVolumeClaim'))}"
        ]
    validator = jsonschema.Draft4Validator(schema)
    found = sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in found]


def file_errors(path: Path) -> list[str]:
    """The errors of every document in a (multi-document) YAML file, each prefixed by kind and name."""
    lines = []
    for document in yaml.safe_load_all(path.read_text()):
        name = (
            f"{document.get('kind')}/{document.get('metadata', {}).get('name')}"
            if isinstance(document, dict)
            else "?"
        )
        lines += [f"{path.name}: {name}: {line}" for line in errors(document)]
    return lines


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or sorted(K8S.glob("*.yaml"))
    problems = [line for path in paths for line in file_errors(path)]
    print("\n".join(problems) or f"valid: {', '.join(path.name for path in paths)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
