"""Cluster files for a GPU profile: a Ray cluster-launcher YAML (AWS) and a KubeRay RayJob manifest.

    python -m cluster.render --cluster a100x64 [--recipe vit_h14_i21k] [--out rendered]

writes `<out>/<profile>/cluster.yaml` (`ray up` it) and `<out>/<profile>/rayjob.yaml` (`kubectl apply -f` it). The
Jobs API is bound to 127.0.0.1 (launcher) or kept inside the namespace with token authentication (KubeRay).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from cluster.driver.job import PLAN_ENV, JobSpec
from cluster.plan.planner import build_plan, resolve_config, runtime_pip, storage_extras
from cluster.profiles import ClusterProfile, load_profile
from data_pipeline.cli import output_folder

RAY_VERSION = "2.60.0"
IMAGE = f"rayproject/ray-ml:{RAY_VERSION}-py311-gpu"
SHARED_FS = "/fsx"  # the checkpoint root's mount on every node (FSx for Lustre / a PVC)


def _gpus(profile: ClusterProfile) -> int:
    return profile.hardware.gpus_per_node


def _install_spec(profile: ClusterProfile, project: str) -> str:
    """`<project>[s3]`-style pip target with the extras the shard storage needs."""
    extras = ",".join(e.name for e in storage_extras([profile.storage.shards]))
    return f"'{project}[{extras}]'" if extras else project


def _check_renderable(profile: ClusterProfile) -> None:
    if profile.is_local:
        raise ValueError(
            "profile local runs on this machine and needs no cluster files; pick a GPU profile "
            "(a100x8, a100x64, h100x8)"
        )
    if not profile.hardware.instance_type:
        raise ValueError(f"profile {profile.name}: hardware.instance_type is empty; set e.g. p4de.24xlarge")
    if not profile.storage.checkpoints.startswith(SHARED_FS):
        raise ValueError(
            f"profile {profile.name}: storage.checkpoints={profile.storage.checkpoints!r} must live on "
            f"the shared filesystem mounted at {SHARED_FS} so every node resumes from the same folder"
        )


def launcher_config(profile: ClusterProfile) -> dict:
    """The `ray up` YAML; validated by Ray's own schema in tests."""
    _check_renderable(profile)
    hw = profile.hardware
    setup = [
        # FSx for Lustre; its DNS name comes from the environment.
        f"sudo mkdir -p {SHARED_FS} && (mountpoint -q {SHARED_FS} || sudo mount -t lustre -o relatime,flock "
        f"$FSX_DNS@tcp:/$FSX_MOUNT {SHARED_FS})",
        f"pip install -e {_install_spec(profile, f'{SHARED_FS}/vitscale')}",
    ]
    node_types = {
        "head": {
            "resources": {"CPU": hw.cpus_per_node, "GPU": _gpus(profile)},
            "node_config": {
                "InstanceType": hw.instance_type,
                "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 500, "VolumeType": "gp3"}}],
            },
        },
        "gpu_worker": {
            "min_workers": hw.nodes - 1,
            "max_workers": hw.nodes - 1,
            "resources": {"CPU": hw.cpus_per_node, "GPU": _gpus(profile)},
            "node_config": {
                "InstanceType": hw.instance_type,
                "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 500, "VolumeType": "gp3"}}],
                # One placement group: one EFA spine for NCCL.
                "Placement": {"GroupName": f"vitscale-{profile.name}"},
            },
        },
    }
    max_workers = hw.nodes - 1
    if profile.evals.instance_type:
        node_types["eval_worker"] = {
            "min_workers": 1,
            "max_workers": 1,
            "resources": {"CPU": profile.evals.num_cpus, "GPU": profile.evals.num_gpus},
            "node_config": {"InstanceType": profile.evals.instance_type},
        }
        max_workers += 1
    return {
        "cluster_name": f"vitscale-{profile.name}",
        "max_workers": max_workers,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 30,
        "docker": {
            "image": IMAGE,
            "container_name": "ray_container",
            "pull_before_run": True,
            "run_options": ["--ulimit nofile=65536:65536", "--shm-size=64g", f"-v {SHARED_FS}:{SHARED_FS}"],
        },
        "provider": {
            "type": "aws",
            "region": "us-east-1",
            "availability_zone": "us-east-1a",
            "cache_stopped_nodes": False,
        },
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": node_types,
        "head_node_type": "head",
        "file_mounts": {},
        "initialization_commands": [],
        "setup_commands": setup,
        "head_setup_commands": [],
        "worker_setup_commands": [],
        # Jobs API on 127.0.0.1 (`ray dashboard` tunnels it over SSH), token auth on.
        "head_start_ray_commands": [
            "ray stop",
            "ray get-auth-token --generate >/dev/null",
            "ulimit -n 65536; RAY_AUTH_MODE=token ray start --head --port=6379 --dashboard-host=127.0.0.1 "
            "--autoscaling-config=~/ray_bootstrap_config.yaml --disable-usage-stats",
        ],
        "worker_start_ray_commands": [
            "ray stop",
            "ulimit -n 65536; RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:6379",
        ],
    }


def _pod(profile: ClusterProfile, cpus: float, gpus: float, memory_gb: float) -> dict:
    limits = {"cpu": str(int(cpus)), "memory": f"{int(memory_gb)}Gi"}
    if gpus:
        limits["nvidia.com/gpu"] = str(int(gpus))
        limits["vpc.amazonaws.com/efa"] = "4" if profile.hardware.gpus_per_node >= 8 else "1"
    return {
        "spec": {
            "containers": [
                {
                    "name": "ray",
                    # ray-ml + this repo, as the launcher's setup_commands.
                    "image": f"vitscale:{RAY_VERSION}",
                    "env": [
                        {"name": "RAY_AUTH_MODE", "value": "token"},
                        {
                            "name": "RAY_AUTH_TOKEN",
                            "valueFrom": {"secretKeyRef": {"name": "vitscale-ray-token", "key": "token"}},
                        },
                    ],
                    "resources": {"limits": limits, "requests": limits},
                    "volumeMounts": [
                        {"name": "fsx", "mountPath": SHARED_FS},
                        {"name": "dshm", "mountPath": "/dev/shm"},
                    ],
                }
            ],
            "volumes": [
                {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
            ],
        }
    }


def _runtime_env(job_spec_json: str) -> dict:
    """The plan for the driver, and pip installs of the plan's extras (as `cluster.launch`)."""
    env: dict = {"env_vars": {PLAN_ENV: job_spec_json}}
    pip = runtime_pip(json.loads(job_spec_json)["plan"])
    if pip:
        env["pip"] = pip
    return env


def rayjob_manifest(profile: ClusterProfile, job_spec_json: str, job_name: str) -> list[dict]:
    """A KubeRay RayJob and a NetworkPolicy keeping the Jobs API inside the namespace."""
    _check_renderable(profile)
    hw = profile.hardware
    node_memory = hw.memory_gb_per_node * 0.9  # leave room for the kubelet
    worker_groups = [
        {
            "groupName": "gpu",
            "replicas": hw.nodes - 1,
            "minReplicas": hw.nodes - 1,
            "maxReplicas": hw.nodes - 1,
            "rayStartParams": {},
            "template": _pod(profile, hw.cpus_per_node - 2, _gpus(profile), node_memory),
        }
    ]
    if profile.evals.instance_type:
        worker_groups.append(
            {
                "groupName": "eval",
                "replicas": 1,
                "minReplicas": 1,
                "maxReplicas": 1,
                "rayStartParams": {},
                "template": _pod(profile, profile.evals.num_cpus, profile.evals.num_gpus, 30),
            }
        )
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": job_name, "labels": {"app": "vitscale"}},
        "spec": {
            "entrypoint": "python -m cluster.driver",
            "runtimeEnvYAML": yaml.safe_dump(_runtime_env(job_spec_json), width=10**9),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 3600,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "headGroupSpec": {
                    # Open to the pod network; the NetworkPolicy and the token keep others out.
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": str(_gpus(profile))},
                    "template": _pod(profile, hw.cpus_per_node - 2, _gpus(profile), node_memory),
                },
                "workerGroupSpecs": worker_groups,
            },
        },
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{job_name}-jobs-api"},
        "spec": {
            "podSelector": {"matchLabels": {"ray.io/node-type": "head"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {}}]}],  # same namespace only
        },
    }
    return [rayjob, policy]


def render(profile_name: str, recipe: str, out: Path) -> list[Path]:
    profile = load_profile(profile_name)
    run_name = f"{Path(recipe).stem}-{profile.name}"
    config = resolve_config(profile, recipe, [], run_name)
    plan = build_plan(profile, config)
    spec = JobSpec.create(profile, config, plan)
    folder = out / profile.name
    folder.mkdir(parents=True, exist_ok=True)
    launcher = folder / "cluster.yaml"
    launcher.write_text(
        f"# Ray cluster launcher for profile {profile.name}: `ray up {launcher}`\n"
        + yaml.safe_dump(launcher_config(profile), sort_keys=False, width=120)
    )
    rayjob = folder / "rayjob.yaml"
    rayjob.write_text(
        f"# KubeRay RayJob for {recipe} on profile {profile.name}: `kubectl apply -f {rayjob}`\n"
        "# (first: kubectl create secret generic vitscale-ray-token --from-literal=token=$(uuidgen))\n"
        + yaml.safe_dump_all(
            rayjob_manifest(profile, spec.to_json(), run_name.replace("_", "-")), sort_keys=False, width=120
        )
    )
    return [launcher, rayjob]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.render", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="a GPU profile: a100x8, a100x64, h100x8")
    parser.add_argument("--recipe", default="vit_b16_i21k", help="recipe the RayJob runs (default vit_b16_i21k)")
    parser.add_argument("--out", default="rendered", help="output folder (default ./rendered)")
    args = parser.parse_args(argv)
    try:
        _check_renderable(load_profile(args.cluster))  # before planning: its errors would mislead
        for path in render(args.cluster, args.recipe, output_folder(args.out, "--out")):
            print(f"wrote {path}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
