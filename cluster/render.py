"""Cluster files for a GPU profile: a Ray cluster-launcher YAML (AWS) and a KubeRay RayJob manifest.

    python -m cluster.render --cluster a100x64 [--recipe vit_h14_i21k] [--run-name NAME] [--out rendered]
        [--image REGISTRY/vitscale:TAG] [--fsx-dns fs-ID.fsx.us-east-1.amazonaws.com --fsx-mount-name NAME]
        [--subnet-id subnet-ID --security-group-id sg-ID]    # EFA profiles (a100x64): their nodes' EFA interfaces
        [--ami-id ami-ID]                                    # the nodes' AMI: an NVIDIA driver for the image's CUDA

writes `<out>/<profile>/cluster.yaml` (`ray up` it) and `rayjob.yaml` (`kubectl apply -f` it), each headed by what
must exist first. Every node runs ./Dockerfile's image; the Jobs API stays on 127.0.0.1 or in the namespace, tokens on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.driver.courier import CLUSTER_TTL_ENV
from cluster.driver.job import JobSpec, job_runtime_env
from cluster.jobs import JOB_METADATA
from cluster.network import EFA_DEVICES, efa_interfaces
from cluster.plan.planner import build_plan, resolve_config
from cluster.profiles import (
    EVAL_INSTANCES,
    EVAL_NODE_LABELS,
    EVAL_NODE_RESOURCE,
    EVAL_NODE_UNITS,
    ClusterProfile,
    allocatable,
    load_profile,
    path_under,
)
from data_pipeline.cli import fail, interrupted, output_folder
from data_pipeline.paths import PROJECT_ROOT, write_text_atomically
from tracking.store import DELIVER_COMMAND

RAY_VERSION = "2.60.0"  # = this venv's Ray (a test holds them equal)
BASE_IMAGE = f"rayproject/ray:{RAY_VERSION}-py311-gpu"  # ./Dockerfile's base; Ray published ray-ml up to 2.49 only
DOCKERFILE = PROJECT_ROOT / "Dockerfile"
IMAGE = f"registry.example.com/vitscale:ray{RAY_VERSION}"  # placeholder: where you push ./Dockerfile's image
IMAGE_CODE_DIR = "/home/ray/vitscale"  # the Dockerfile's WORKDIR: the code a KubeRay job runs
SHARED_FS = "/fsx"  # the checkpoint root's mount on every node (FSx for Lustre / a PVC)
ROOT_DEVICE, ROOT_GB = "/dev/sda1", 500  # an Ubuntu AMI's root device, and the training nodes' root disk (the image)
IMDS = "http://169.254.169.254/latest"  # EC2's instance metadata, from the host
REGION, ZONE = "us-east-1", "us-east-1a"
AUTH_TOKEN_FILE = "~/.ray/auth_token"  # `ray get-auth-token --generate` writes it, `ray start` reads it
TOKEN_SECRET = "vitscale-ray-token"  # KubeRay: the secret holding the token, under the key KubeRay reads
TOKEN_KEY = "auth_token"
# The KubeRay operator polls the head's Jobs API for the job's state: with the token it reads from authOptions (KubeRay
# 1.6+), from its own namespace, whose pods both install routes (Helm, kustomize) label so.
KUBERAY_VERSION = "1.6.0"  # the first with authOptions.secretName
OPERATOR_LABELS = {"app.kubernetes.io/component": "kuberay-operator"}
DASHBOARD_PORT = 8265  # Ray's, which the head keeps
MLFLOW_SECRET = "vitscale-mlflow"  # KubeRay: the optional secret of MLflow's credentials, one key per variable
MAX_RAYJOB_NAME = 47  # KubeRay: its RayCluster's 53, less the 6 characters of the cluster's suffix
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
CLUSTER_TTL_S = 3600  # KubeRay deletes the RayJob's cluster this long after the job ends


@dataclass(frozen=True)
class FsxMount:
    """An FSx for Lustre file system: its DNS name and mount name (the AWS console's "Attach" shows both)."""

    dns_name: str
    mount_name: str

    @property
    def source(self) -> str:
        return f"{self.dns_name}@tcp:/{self.mount_name}"


def fsx_mount(dns_name: str | None, mount_name: str | None) -> FsxMount | None:
    """The file system of `--fsx-dns` and `--fsx-mount-name`, None without either; plain names (a shell runs them)."""
    if not dns_name and not mount_name:
        return None
    if not dns_name or not mount_name:
        raise ValueError("--fsx-dns and --fsx-mount-name go together: give both names of the FSx file system")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", dns_name):
        raise ValueError(f"--fsx-dns {dns_name!r} is no DNS name; give e.g. fs-0123abcd.fsx.{REGION}.amazonaws.com")
    if not re.fullmatch(r"[A-Za-z0-9]+", mount_name):
        raise ValueError(f"--fsx-mount-name {mount_name!r}: letters and digits only, e.g. abcdefgh (or fsx)")
    region = re.search(r"\.fsx\.([a-z0-9-]+)\.amazonaws\.com$", dns_name)
    if region and region.group(1) != REGION:
        raise ValueError(f"--fsx-dns {dns_name}: the file system is in {region.group(1)}, the cluster in {REGION}")
    return FsxMount(dns_name, mount_name)


def ami_id(value: str | None) -> str | None:
    """`--ami-id`, checked: an EC2 AMI id (the headers' shell commands name it), None without it."""
    if value is not None and not re.fullmatch(r"ami-([0-9a-f]{8}|[0-9a-f]{17})", value):
        raise ValueError(f"--ami-id {value!r}: give an EC2 AMI id in {REGION}, ami- and 8 or 17 hex digits")
    return value


def _no_ami() -> str:
    """The host command stopping `ray up` rendered without `--ami-id`: Ray's AWS default AMI is the deprecated Deep
    Learning AMI (Ubuntu 18.04) V71, whose CUDA 11 driver knows no H100 or H200 and runs no CUDA 12 image."""
    return (
        "echo 'cluster.yaml names no AMI, and the one Ray picks has a CUDA 11 driver: render it with --ami-id (an "
        "Ubuntu Deep Learning Base OSS Nvidia Driver GPU AMI)' >&2; exit 1"
    )


def _check_image(image: str) -> None:
    """ValueError where `--image` is no image reference: the headers' shell commands name it."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*", image):
        raise ValueError(
            f"--image {image!r} is no image reference: letters, digits and . _ / : @ - only, no spaces; "
            f"give REGISTRY/NAME:TAG, e.g. {IMAGE}"
        )


def _check_renderable(profile: ClusterProfile) -> None:
    if profile.is_local:
        raise ValueError(
            f"profile {profile.name} runs on this machine and needs no cluster files; pick a GPU profile "
            "(a100x8, a100x64, h100x8, h200x8)"
        )
    if not profile.hardware.instance_type:
        raise ValueError(f"profile {profile.name}: hardware.instance_type is empty; set e.g. p4de.24xlarge")
    if profile.storage.shared not in ("", SHARED_FS):  # the plan would take a path under it as shared
        raise ValueError(
            f"profile {profile.name}: storage.shared={profile.storage.shared!r}: the files mount FSx at {SHARED_FS}; "
            f"set storage.shared={SHARED_FS} or leave it out"
        )
    if not path_under(profile.storage.checkpoints, SHARED_FS):
        raise ValueError(
            f"profile {profile.name}: storage.checkpoints={profile.storage.checkpoints!r} must live on "
            f"the shared filesystem mounted at {SHARED_FS} so every node resumes from the same folder"
        )


def rayjob_name(run_name: str) -> str:
    """``run_name`` as KubeRay takes a RayJob's name (a DNS-1035 label): lowercase, '-' for '_' and '.'."""
    name = re.sub(r"[._]", "-", run_name.lower())
    if len(name) > MAX_RAYJOB_NAME or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        raise ValueError(
            f"RayJob name {name!r} (the run name {run_name!r}, {len(name)} characters): KubeRay takes at most "
            f"{MAX_RAYJOB_NAME} letters, digits and '-', a letter first and a letter or digit last; give --run-name, "
            "e.g. vit-b16-try2"
        )
    return name


def placement_group(profile: ClusterProfile) -> str | None:
    """The training nodes' EC2 placement group (one EFA spine for NCCL), None on one node; made before `ray up`."""
    return f"vitscale-{profile.name}" if profile.hardware.nodes > 1 else None


def _mount_fsx(fsx: FsxMount | None) -> str:
    """The host command mounting FSx before docker starts (for `-v /fsx:/fsx`), or stopping `ray up` with the reason."""
    if fsx is None:
        return (
            f"echo 'cluster.yaml names no FSx file system to mount at {SHARED_FS}: render it with --fsx-dns and "
            "--fsx-mount-name' >&2; exit 1"
        )
    return (
        f"sudo mkdir -p {SHARED_FS} && (mountpoint -q {SHARED_FS} || sudo mount -t lustre -o relatime,flock "
        f"{fsx.source} {SHARED_FS})"
    )


@dataclass(frozen=True)
class EfaSubnet:
    """Where a training node's EFA interfaces go: EC2 takes the subnet and security group per interface."""

    subnet_id: str
    security_group_id: str  # must allow all traffic from itself (EFA's own requirement)


def efa_subnet(subnet_id: str | None, security_group_id: str | None) -> EfaSubnet | None:
    """`--subnet-id` and `--security-group-id`, both or neither; ValueError naming the bad one."""
    if subnet_id is None and security_group_id is None:
        return None
    if subnet_id is None or security_group_id is None:
        raise ValueError("--subnet-id and --security-group-id go together: EC2 takes both for each EFA interface")
    for flag, value, prefix in (("--subnet-id", subnet_id, "subnet"), ("--security-group-id", security_group_id, "sg")):
        if not re.fullmatch(rf"{prefix}-([0-9a-f]{{8}}|[0-9a-f]{{17}})", value):
            raise ValueError(f"{flag} {value!r}: give an EC2 id, {prefix}- and 8 or 17 hex digits")
    return EfaSubnet(subnet_id, security_group_id)


def _efa_interfaces(count: int, efa: EfaSubnet) -> list[dict]:
    """One EFA interface per network card, the first the node's primary interface (device index 0)."""
    return [
        {
            "NetworkCardIndex": card,
            "DeviceIndex": 0 if card == 0 else 1,
            "InterfaceType": "efa",
            "SubnetId": efa.subnet_id,
            "Groups": [efa.security_group_id],
        }
        for card in range(count)
    ]


def _efa_run_options(count: int) -> list[str]:
    """What docker needs to hand a container the node's EFA: its devices, and unlimited locked memory for the NIC."""
    if not count:
        return []
    return ["--ulimit memlock=-1:-1", *(f"--device={EFA_DEVICES}/uverbs{i}" for i in range(count))]


def _no_efa(profile: ClusterProfile) -> str:
    """The host command stopping `ray up` of an EFA profile rendered without its subnet: its ranks would use TCP."""
    return (
        f"echo 'profile {profile.name} trains over EFA, and cluster.yaml gives its nodes no EFA interface: render it "
        "with --subnet-id and --security-group-id' >&2; exit 1"
    )


def _root_device_check() -> str:
    """The host command stopping `ray up` where the AMI's root device is not the one the training nodes' 500 GB go to:
    EC2 then attaches them as a second, unused volume and the image, logs and spills fill the AMI's small root."""
    token = f"curl -sf -m 5 -X PUT {IMDS}/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 60'"
    root = 'curl -sf -m 5 -H "X-aws-ec2-metadata-token: $(' + token + f')" {IMDS}/meta-data/block-device-mapping/root'
    return (
        f'root=$({root}); [ -z "$root" ] || [ "$root" = {ROOT_DEVICE} ] || {{ echo "the AMI boots from $root, and '
        f"cluster.yaml gives {ROOT_DEVICE} (an Ubuntu AMI's root) its {ROOT_GB} GB: render it for an Ubuntu AMI\" "
        ">&2; false; }"
    )


def _training_node(profile: ClusterProfile, efa: EfaSubnet | None) -> dict:
    ebs = {"VolumeSize": ROOT_GB, "VolumeType": "gp3"}
    node: dict = {
        "InstanceType": profile.hardware.instance_type,
        "BlockDeviceMappings": [{"DeviceName": ROOT_DEVICE, "Ebs": ebs}],
    }
    if group := placement_group(profile):  # the head trains too
        node["Placement"] = {"GroupName": group}
    if (count := efa_interfaces(profile)) and efa is not None:
        node["NetworkInterfaces"] = _efa_interfaces(count, efa)
    return node


def _join_subnet(node_config: dict, efa: EfaSubnet | None) -> None:
    """The given subnet and group for a node without EFA interfaces (which carry them): Ray's AWS setup would give it
    a subnet of its own choosing and a new group the others' group does not let in, and it would never join."""
    if efa is not None and "NetworkInterfaces" not in node_config:
        node_config["SubnetIds"] = [efa.subnet_id]
        node_config["SecurityGroupIds"] = [efa.security_group_id]


def _node_type(workers: int | None, cpus: int, gpus: int, node_config: dict, **custom: int) -> dict:
    counts = {} if workers is None else {"min_workers": workers, "max_workers": workers}
    return {**counts, "resources": {"CPU": cpus, "GPU": gpus, **custom}, "node_config": node_config}


def launcher_config(
    profile: ClusterProfile,
    image: str = IMAGE,
    fsx: FsxMount | None = None,
    efa: EfaSubnet | None = None,
    ami: str | None = None,
) -> dict:
    """The `ray up` YAML; validated by Ray's own schema in tests."""
    _check_renderable(profile)
    hw = profile.hardware
    devices = _efa_run_options(efa_interfaces(profile))  # the training nodes': an eval node has no EFA device
    node_types = {
        "head": _node_type(None, hw.cpus_per_node, hw.gpus_per_node, _training_node(profile, efa)),
        "gpu_worker": _node_type(hw.nodes - 1, hw.cpus_per_node, hw.gpus_per_node, _training_node(profile, efa)),
    }
    if devices:
        node_types["gpu_worker"]["docker"] = {"worker_run_options": list(devices)}  # a copy: no YAML anchors
    if profile.evals.instance_type:
        vcpus, _, gpus = EVAL_INSTANCES[profile.evals.instance_type]
        eval_node = {"InstanceType": profile.evals.instance_type}
        node_types["eval_worker"] = _node_type(1, vcpus, gpus, eval_node, **{EVAL_NODE_RESOURCE: EVAL_NODE_UNITS})
        node_types["eval_worker"]["labels"] = dict(EVAL_NODE_LABELS)  # the ranks' label selector skips it
    for node_type in node_types.values():
        _join_subnet(node_type["node_config"], efa)
    if ami:  # every node type: Ray gives one without ImageId its own default AMI (`_no_ami`)
        for node_type in node_types.values():
            node_type["node_config"]["ImageId"] = ami
    return {
        "cluster_name": f"vitscale-{profile.name}",
        "max_workers": sum(t.get("max_workers", 0) for t in node_types.values()),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 30,
        "docker": {
            "image": image,  # the code comes with each job
            "container_name": "ray_container",
            "pull_before_run": True,
            "run_options": ["--ulimit nofile=65536:65536", "--shm-size=64g", f"-v {SHARED_FS}:{SHARED_FS}"],
            **({"head_run_options": devices} if devices else {}),  # the head trains too
        },
        "provider": {
            "type": "aws",
            "region": REGION,
            "availability_zone": ZONE,
            "cache_stopped_nodes": False,
            # EC2 gives an instance of several network interfaces no public IP: Ray reaches the nodes inside the VPC
            **({"use_internal_ips": True} if devices and efa is not None else {}),
        },
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": node_types,
        "head_node_type": "head",
        # The client's token, in every node's container (the autoscaler passes file_mounts on to workers).
        "file_mounts": {AUTH_TOKEN_FILE: AUTH_TOKEN_FILE},
        "initialization_commands": [
            *([] if ami else [_no_ami()]),
            _root_device_check(),
            _mount_fsx(fsx),
            *([_no_efa(profile)] if devices and efa is None else []),
        ],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        # Jobs API on 127.0.0.1 (`ray dashboard` tunnels it over SSH), token auth on.
        "head_start_ray_commands": [
            "ray stop",
            "ulimit -n 65536; RAY_AUTH_MODE=token ray start --head --port=6379 --dashboard-host=127.0.0.1 "
            "--autoscaling-config=~/ray_bootstrap_config.yaml --disable-usage-stats",
        ],
        "worker_start_ray_commands": [
            "ray stop",
            "ulimit -n 65536; RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:6379",
        ],
    }


def _ray_auth_env() -> list[dict]:
    """Token authentication with the namespace's secret, for every pod that starts Ray or talks to it."""
    return [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": TOKEN_SECRET, "key": TOKEN_KEY}}},
    ]


def _mlflow_env() -> list[dict]:
    """MLflow's credentials from the namespace's optional secret, never in the runtime env or logs (docs/design.md)."""
    return [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": MLFLOW_SECRET, "key": key, "optional": True}}}
        for key in MLFLOW_SECRET_KEYS
    ]


def _pod(image: str, instance_type: str, node: tuple[int, float, int], efa: int = 0) -> dict:
    """A Ray pod asking for what a node of (vCPUs, GiB, GPUs) can give it, on a node of that type only: an eval pod
    on a training node would take a GPU a training pod waits for."""
    vcpus, memory_gb, gpus = node
    cpus, memory_gb = allocatable(vcpus, memory_gb)
    limits = {"cpu": str(cpus), "memory": f"{int(memory_gb)}Gi"}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    if efa:
        limits["vpc.amazonaws.com/efa"] = str(efa)
    return {
        "spec": {
            "nodeSelector": {"node.kubernetes.io/instance-type": instance_type},  # the kubelet's well-known label
            "containers": [
                {
                    "name": "ray",
                    "image": image,
                    # the job's end tells a courier's reader that it dies with the cluster
                    "env": [*_ray_auth_env(), *_mlflow_env(), {"name": CLUSTER_TTL_ENV, "value": str(CLUSTER_TTL_S)}],
                    "resources": {"limits": limits, "requests": dict(limits)},  # a copy: no YAML anchors
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


def _training_pod(profile: ClusterProfile, image: str) -> dict:
    hw = profile.hardware
    node = (hw.cpus_per_node, hw.memory_gb_per_node, hw.gpus_per_node)
    return _pod(image, hw.instance_type, node, efa_interfaces(profile))


def _submitter(image: str) -> dict:
    """The pod running `ray job submit` (working_dir from this image): KubeRay's own has no token."""
    limits = {"cpu": "1", "memory": "1Gi"}
    container = {"name": "ray-job-submitter", "image": image, "env": _ray_auth_env()}
    container["resources"] = {"limits": limits, "requests": dict(limits)}
    return {"spec": {"restartPolicy": "Never", "containers": [container]}}


def _worker_group(name: str, replicas: int, template: dict, **custom: int) -> dict:
    counts = {"replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas}
    params = {"resources": json.dumps(json.dumps(custom))} if custom else {}  # `ray start --resources` takes JSON
    return {"groupName": name, **counts, "rayStartParams": params, "template": template}


def rayjob_manifest(profile: ClusterProfile, job_spec_json: str, job_name: str, image: str = IMAGE) -> list[dict]:
    """A KubeRay RayJob and a NetworkPolicy keeping the Jobs API inside the namespace."""
    _check_renderable(profile)
    hw = profile.hardware
    worker_groups = [_worker_group("gpu", hw.nodes - 1, _training_pod(profile, image))]
    if profile.evals.instance_type:  # no EFA: evals need none, small types have none
        eval_type = profile.evals.instance_type
        eval_pod = _pod(image, eval_type, EVAL_INSTANCES[eval_type])
        worker_groups.append(_worker_group("eval", 1, eval_pod, **{EVAL_NODE_RESOURCE: EVAL_NODE_UNITS}))
        worker_groups[-1]["labels"] = dict(EVAL_NODE_LABELS)  # KubeRay 1.5+: the group's Ray node labels
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": job_name, "labels": {"app": "vitscale"}},
        "spec": {
            "entrypoint": "python -m cluster.driver",
            "runtimeEnvYAML": yaml.safe_dump(job_runtime_env(profile, job_spec_json, IMAGE_CODE_DIR), width=10**9),
            "metadata": dict(JOB_METADATA),  # `ray job submit --metadata-json`: `make status/logs/stop` count the job
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": CLUSTER_TTL_S,
            "submitterPodTemplate": _submitter(image),
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "authOptions": {"mode": "token", "secretName": TOKEN_SECRET},  # the operator's requests carry it
                "headGroupSpec": {
                    # Open to the pod network; the NetworkPolicy and the token keep others out.
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": str(hw.gpus_per_node)},
                    "template": _training_pod(profile, image),
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
            "ingress": [
                {"from": [{"podSelector": {}}]},  # the namespace's pods
                {  # the operator, wherever it runs, to the Jobs API only
                    "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_LABELS}}],
                    "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}],
                },
            ],
        },
    }
    return [rayjob, policy]


def _build_image(image: str) -> str:
    return f"docker build -t {image} {PROJECT_ROOT} && docker push {image}"


def _launcher_header(profile: ClusterProfile, path: Path, image: str) -> str:
    lines = [
        f"Ray cluster launcher for profile {profile.name}: `ray up {path}`, once these exist:",
        f"  {_build_image(image)}",
        f"  ray get-auth-token --generate  # {AUTH_TOKEN_FILE} here, copied to every node",
    ]
    if group := placement_group(profile):
        lines.append(f"  aws ec2 create-placement-group --region {REGION} --group-name {group} --strategy cluster")
    lines.append(f"and an FSx for Lustre file system in {ZONE}, mounted at {SHARED_FS} (--fsx-dns, --fsx-mount-name).")
    lines.append(
        f"Every node boots an Ubuntu AMI in {REGION} with an NVIDIA driver for the image's CUDA, Docker, the NVIDIA "
        "container toolkit and the Lustre client, e.g. a Deep Learning Base OSS Nvidia Driver GPU AMI (--ami-id)."
    )
    if count := efa_interfaces(profile):
        lines.append(
            f"Its nodes' {count} EFA interfaces each need a subnet in {ZONE} and a security group "
            "letting in all traffic from itself (--subnet-id, --security-group-id; docs/network.md), which every "
            "node, the eval node too, joins. EC2 gives an "
            "instance of several interfaces no public IP: run `ray up` and `ray dashboard` from a machine in that "
            "subnet's VPC (the file sets use_internal_ips), and give the subnet a NAT gateway for the image pull."
        )
    return _comment(lines)


def _rayjob_header(profile: ClusterProfile, path: Path, recipe: str, image: str, run_dir: str) -> str:
    lines = [
        f"KubeRay RayJob for {recipe} on profile {profile.name}, run folder {run_dir} (a later apply resumes it;",
        f"--run-name renders another run): `kubectl apply -f {path}`, once these exist:",
        f"  {_build_image(image)}  # the job runs the code of this image",
        f"  kubectl create secret generic {TOKEN_SECRET} --from-literal={TOKEN_KEY}=$(uuidgen)",
        "  the KubeRay operator 1.6 or later and its CRDs (authOptions.secretName; `helm upgrade` keeps the old "
        "CRDs, and kubectl refuses this file: unknown field ...authOptions.secretName)",
        f'  kubectl replace -k "github.com/ray-project/kuberay/ray-operator/config/crd?ref=v{KUBERAY_VERSION}"  # CRDs',
        f"  kubectl create secret generic {MLFLOW_SECRET} --from-literal=MLFLOW_TRACKING_TOKEN=...  # if MLflow "
        "wants credentials (or _USERNAME and _PASSWORD)",
        f"and a PersistentVolumeClaim fsx-claim (FSx for Lustre) in the namespace, mounted at {SHARED_FS}.",
        f"KubeRay deletes the RayCluster {CLUSTER_TTL_S // 60} min after the job ends, and with it the courier that "
        "sends the run's MLflow",
        "records where MLflow was down at the job's end; if it stays down that long, once it is back, in a pod of the "
        "image mounting fsx-claim:",
        f"  {DELIVER_COMMAND} {run_dir}",
    ]
    return _comment(lines)


def _comment(lines: list[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)


def _names(profile: ClusterProfile, recipe: str, run_name: str | None) -> tuple[str, str]:
    """The run's name (default ``<recipe>-<profile>``) and its RayJob's; ValueError where KubeRay refuses it."""
    run_name = run_name or f"{Path(recipe).stem}-{profile.name}"
    return run_name, rayjob_name(run_name)


def render(
    profile_name: str,
    recipe: str,
    out: Path,
    image: str = IMAGE,
    fsx: FsxMount | None = None,
    run_name: str | None = None,
    efa: EfaSubnet | None = None,
    ami: str | None = None,
) -> list[Path]:
    """Write ``out/<profile>/cluster.yaml`` and ``rayjob.yaml``; the run is named ``<recipe>-<profile>`` by default."""
    profile = load_profile(profile_name)
    run_name, job_name = _names(profile, recipe, run_name)
    config = resolve_config(profile, recipe, [], run_name)
    spec = JobSpec.create(profile, config, build_plan(profile, config))
    folder = out / profile.name
    folder.mkdir(parents=True, exist_ok=True)
    launcher = folder / "cluster.yaml"
    write_text_atomically(
        launcher,
        _launcher_header(profile, launcher, image)
        + yaml.safe_dump(launcher_config(profile, image, fsx, efa, ami), sort_keys=False, width=120),
    )
    rayjob = folder / "rayjob.yaml"
    manifest = rayjob_manifest(profile, spec.to_json(), job_name, image)
    header = _rayjob_header(profile, rayjob, recipe, image, config.checkpoint.dir)
    write_text_atomically(rayjob, header + yaml.safe_dump_all(manifest, sort_keys=False, width=120))
    return [launcher, rayjob]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.render", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="a GPU profile: a100x8, a100x64, h100x8, h200x8")
    parser.add_argument("--recipe", help="recipe the RayJob runs (default: the profile's recipe)")
    parser.add_argument(
        "--run-name",
        help="run folder under the profile's checkpoints (default <recipe>-<profile>); a used name resumes that run",
    )
    parser.add_argument("--out", default="rendered", help="output folder (default ./rendered)")
    parser.add_argument("--image", default=IMAGE, help=f"the image ./Dockerfile builds, pushed (default {IMAGE})")
    parser.add_argument("--fsx-dns", help="the FSx for Lustre file system's DNS name (launcher: mounted at /fsx)")
    parser.add_argument("--fsx-mount-name", help="the FSx for Lustre file system's mount name")
    parser.add_argument("--subnet-id", help="launcher, EFA profiles: the subnet of the nodes' EFA interfaces")
    parser.add_argument(
        "--security-group-id", help="launcher, EFA profiles: their security group (all traffic from itself)"
    )
    parser.add_argument(
        "--ami-id", help=f"launcher: the nodes' Ubuntu AMI in {REGION}, its NVIDIA driver new enough for the image"
    )
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.cluster)
        _check_renderable(profile)  # before planning: its errors would mislead
        fsx = fsx_mount(args.fsx_dns, args.fsx_mount_name)
        efa = efa_subnet(args.subnet_id, args.security_group_id)
        ami = ami_id(args.ami_id)
        needs = efa_interfaces(profile)  # before --out: an instance type without a known count is refused
        _check_image(args.image)
        recipe = profile.pick_recipe(args.recipe)
        _names(profile, recipe, args.run_name)  # before --out is created
        out = output_folder(args.out, "--out")
        for path in render(args.cluster, recipe, out, args.image, fsx, args.run_name, efa, ami):
            print(f"wrote {path}")
    except ValueError as exc:
        return fail(parser.prog, exc)
    except KeyboardInterrupt:
        return interrupted(parser.prog, "each file it wrote is whole; run it again")
    if args.image == IMAGE:
        print(f"note: {IMAGE} is a placeholder: push ./Dockerfile's image and pass --image")
    if ami is None:
        print("note: no --ami-id: `ray up` of cluster.yaml stops; Ray's default AMI cannot run the image's CUDA")
    if fsx is None:
        print("note: no --fsx-dns/--fsx-mount-name: `ray up` of cluster.yaml stops before the FSx mount")
    if needs and efa is None:
        print("note: no --subnet-id/--security-group-id: `ray up` of cluster.yaml stops; its nodes would have no EFA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
