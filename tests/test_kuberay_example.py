"""examples/kuberay/rayjob.yaml: a KubeRay RayJob whose entrypoint is a `tempering train` command that loads."""

import shlex
from pathlib import Path

import yaml

from tempering.config import load_config

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "kuberay" / "rayjob.yaml"


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def test_the_manifest_is_a_kuberay_rayjob_with_a_head_and_a_worker_group():
    job = manifest()
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert len(pods) >= 2
    images = {c["image"] for pod in pods for c in pod["spec"]["containers"]}
    assert len(images) == 1  # head and workers run the same tempering
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["requests"]["cpu"]
        env = {e["name"] for e in container["env"]}
        assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= env  # token authentication on every node


def test_the_entrypoint_is_a_tempering_train_command_whose_config_loads_on_ray():
    argv = shlex.split(manifest()["spec"]["entrypoint"])
    assert argv[:2] == ["tempering", "train"]
    config, overrides = argv[2], argv[3:]
    cfg = load_config(ROOT / config, overrides, checks=False)  # a misspelt key or a bad value raises
    assert cfg.distributed.backend == "ray"
    assert cfg.distributed.address == "auto"  # joins the RayJob's cluster rather than starting its own
    assert cfg.checkpoint.uri and "://" in cfg.checkpoint.uri  # pods are ephemeral: checkpoints leave them
