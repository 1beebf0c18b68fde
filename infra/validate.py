"""Validate capline's cluster manifests offline against the schemas kept in infra/schemas/.

    python -m infra.validate [FILE ...]     (default: every YAML file under infra/k8s and infra/ray)

Kubernetes kinds (ConfigMap, CronJob, Job, ...) against Kubernetes v1.33's strict schemas, KubeRay
kinds (RayCluster, RayJob) against kuberay-v1.json, and a Ray cluster launcher config (a document
with `cluster_name`) against Ray's launcher schema. Exit 1 naming each problem's file and path.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SCHEMAS = HERE / "schemas"


def _registry():
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    resources = []
    for name in ("kubernetes-v1.33.json", "kuberay-v1.json"):
        resources.append((name, Resource.from_contents(json.loads((SCHEMAS / name).read_text()),
                                                        default_specification=DRAFT202012)))
    return Registry().with_resources(resources)


def schema_for(doc: dict) -> tuple[str, dict]:
    """-> (what it is, a JSON schema) for one YAML document."""
    if "cluster_name" in doc and "provider" in doc:
        return "ray cluster launcher config", json.loads((SCHEMAS / "ray-cluster-launcher.json").read_text())
    kind = doc.get("kind")
    k8s = json.loads((SCHEMAS / "kubernetes-v1.33.json").read_text())["kinds"]
    if kind in ("RayCluster", "RayJob"):
        return f"KubeRay {kind}", {"$ref": f"kuberay-v1.json#/$defs/{kind}"}
    if kind in k8s:
        return f"Kubernetes {kind}", {"$ref": f"kubernetes-v1.33.json#/$defs/{k8s[kind]}"}
    raise ValueError(f"no schema for kind {kind!r}; known: RayCluster, RayJob, {', '.join(k8s)}")


def validate_file(path: Path) -> list[str]:
    """-> problems, each 'file: what: at path: message' (empty when the file is valid)."""
    from jsonschema import Draft7Validator, Draft202012Validator

    problems = []
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except yaml.YAMLError as err:
        return [f"{path}: not valid YAML ({str(err).splitlines()[0]})"]
    registry = _registry()
    for doc in docs:
        try:
            what, schema = schema_for(doc)
        except ValueError as err:
            problems.append(f"{path}: {err}")
            continue
        cls = Draft7Validator if schema.get("$schema", "").startswith("http://json-schema.org/draft-07") else Draft202012Validator
        for e in sorted(cls(schema, registry=registry).iter_errors(doc), key=lambda e: list(e.absolute_path)):
            where = "/".join(str(p) for p in e.absolute_path) or "(top)"
            problems.append(f"{path}: {what}: at {where}: {e.message[:300]}")
    return problems


def default_files() -> list[Path]:
    return sorted([*HERE.glob("k8s/*.yaml"), *HERE.glob("ray/*.yaml")])


def main(argv: list[str] | None = None) -> int:
    files = [Path(a) for a in (argv if argv is not None else sys.argv[1:])] or default_files()
    problems = [p for f in files for p in validate_file(f)]
    for p in problems:
        print(p)
    print(f"{len(files)} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
