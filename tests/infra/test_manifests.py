"""Cluster manifests, validated offline against the schemas in infra/schemas/ (Kubernetes v1.33
strict, KubeRay v1, Ray's cluster launcher), and checked against capline itself: the ConfigMap's
config loads, the commands parse, the Dockerfile copies what exists. Nothing is built or pulled."""
import copy
import shlex

import pytest
import yaml

from helpers import ROOT
from infra.validate import default_files, main, validate_file

K8S = ROOT / "infra" / "k8s"


def _doc(name):
    return yaml.safe_load((K8S / name).read_text())


def test_every_manifest_is_valid():
    files = default_files()
    assert {f.name for f in files} >= {"configmap.yaml", "raycluster.yaml", "rayjob.yaml", "cronjob.yaml", "cluster.yaml"}
    for f in files:
        assert validate_file(f) == [], f
    assert main([]) == 0


def _mutated(tmp_path, name, change):
    doc = copy.deepcopy(_doc(name) if name != "cluster.yaml" else yaml.safe_load((ROOT / "infra/ray/cluster.yaml").read_text()))
    change(doc)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return validate_file(path)


@pytest.mark.parametrize("name, change, needle", [
    ("cronjob.yaml", lambda d: d["spec"].pop("schedule"), "'schedule' is a required property"),
    ("cronjob.yaml", lambda d: d["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
     .update(imagePullPolicyy="Always"), "imagePullPolicyy"),
    ("raycluster.yaml", lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas="two"), "'two' is not of type 'integer'"),
    ("raycluster.yaml", lambda d: d["spec"]["headGroupSpec"].pop("template"), "'template' is a required property"),
    ("rayjob.yaml", lambda d: d["spec"].update(submissionMode="Bogus"), "'Bogus' is not one of"),
    ("rayjob.yaml", lambda d: d["spec"].pop("clusterSelector"), "is not valid under any of the given schemas"),
    ("configmap.yaml", lambda d: d.update(kind="ConfigMapp"), "no schema for kind 'ConfigMapp'"),
    ("cluster.yaml", lambda d: d.update(max_workerz=3), "max_workerz"),
])
def test_a_broken_manifest_is_named(tmp_path, name, change, needle):
    problems = _mutated(tmp_path, name, change)
    assert problems and any(needle in p for p in problems), problems


def test_the_configmap_holds_a_valid_capline_config(tmp_path):
    from pipeline.config import load_config

    text = _doc("configmap.yaml")["data"]["run.yaml"]
    (tmp_path / "run.yaml").write_text(text)
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.source.kind == "urls" and cfg.run_dir.startswith("/data/")


def test_commands_parse_and_point_at_the_mounted_config():
    from pipeline.cli import _parser

    cron = _doc("cronjob.yaml")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    container = cron["containers"][0]
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    args = _parser().parse_args(container["args"])
    assert args.command == "run" and args.incremental and args.config == f"{mount}/run.yaml"
    job = _doc("rayjob.yaml")["spec"]["entrypoint"]
    words = shlex.split(job)
    assert words[0] == "capline"
    assert _parser().parse_args(words[1:]).config == f"{mount}/run.yaml"
    head = _doc("raycluster.yaml")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert any(m["mountPath"] == mount for m in head["volumeMounts"])   # where the RayJob's entrypoint runs


def test_dockerfile_copies_what_exists_and_pins_the_stack():
    lines = [ln.strip() for ln in (ROOT / "infra/docker/Dockerfile").read_text().splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0].startswith("FROM python:3.11")
    for ln in lines:
        if ln.startswith("COPY"):
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
    text = " ".join(lines)
    torch_pin = next(ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.startswith("torch=="))
    assert torch_pin in text and "-c constraints.txt" in text
    assert 'ENTRYPOINT ["capline"]' in text


def test_gpu_workers_have_a_group_of_their_own_with_the_cuda_image_and_shared_memory():
    groups = {g["groupName"]: g for g in _doc("raycluster.yaml")["spec"]["workerGroupSpecs"]}
    gpu = groups["gpu"]["template"]["spec"]
    box = gpu["containers"][0]
    assert box["image"] == "capline:gpu" and box["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in box["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in gpu["volumes"]
    launcher = yaml.safe_load((ROOT / "infra/ray/cluster.yaml").read_text())["available_node_types"]["gpu_worker"]
    assert launcher["docker"]["worker_image"] == "capline:gpu"
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cu128" in (ROOT / "infra/docker/Dockerfile").read_text()
