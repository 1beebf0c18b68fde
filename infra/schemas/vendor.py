"""Regenerate the vendored schemas the manifest tests validate against, offline.

- `kubernetes-v1.33.json`: the Kubernetes object schemas capline's manifests use.
- `ray-cluster-launcher.json`: the schema Ray's own cluster launcher validates with, as the pinned
  ray package ships it (ray/autoscaler/ray-schema.json).
`kuberay-v1.json` is written by hand (see its description); no package ships KubeRay's CRDs.

Taken from the `kubernetes-validate` package (strict variant, which refuses unknown fields): the
definitions reachable from the kinds below, in one self-contained JSON Schema file, so the tests
validate offline against a file kept in this repository. Run after changing KINDS or the version:

    pip install kubernetes-validate && python infra/schemas/vendor.py
"""
from __future__ import annotations

import json
from pathlib import Path

VERSION = "v1.33.0-local-strict"
KINDS = {  # manifest kind (apiVersion) -> definition name
    "ConfigMap": "io.k8s.api.core.v1.ConfigMap",
    "CronJob": "io.k8s.api.batch.v1.CronJob",
    "Job": "io.k8s.api.batch.v1.Job",
    "ServiceAccount": "io.k8s.api.core.v1.ServiceAccount",
    "PodTemplateSpec": "io.k8s.api.core.v1.PodTemplateSpec",
}


def main() -> None:
    import kubernetes_validate

    src = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / VERSION / "_definitions.json"
    defs = json.loads(src.read_text())["$defs"]
    prefix = '"$ref": "#/$defs/'
    keep, todo = {}, list(KINDS.values())
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        text = json.dumps(defs[name])
        todo += [ref.split('"', 1)[0] for ref in text.split(prefix)[1:]]
        keep[name] = defs[name]   # refs are "#/$defs/...": they resolve within the written file too
    out = {"$schema": "https://json-schema.org/draft/2020-12/schema",
           "description": f"Kubernetes {VERSION} definitions used by capline (from kubernetes-validate)",
           "kinds": KINDS, "$defs": dict(sorted(keep.items()))}
    path = Path(__file__).with_name("kubernetes-v1.33.json")
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path} ({len(keep)} definitions)")
    import ray

    launcher = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    data = json.loads(launcher.read_text())
    data["description"] = f"Ray {ray.__version__} cluster launcher config (from ray/autoscaler/ray-schema.json)"
    target = Path(__file__).with_name("ray-cluster-launcher.json")
    target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
