"""cluster.render: files a cluster can come up from. The `ray up` YAML passes Ray's own config schema for every GPU
profile; every node and pod runs the image ./Dockerfile builds (installed as `make setup` installs); FSx is mounted
on the host; the code comes with the job; every node gets the token; every pod fits its node."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil

import pytest
import yaml

from cluster import render
from cluster.plan.storage import storage_extras
from data_pipeline.paths import PROJECT_ROOT

GPU_PROFILES = ["a100x8", "a100x64", "h100x8", "h200x8"]
PYPROJECT = PROJECT_ROOT / "pyproject.toml"
FSX = render.FsxMount("fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", "abcdefgh")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """profile → (launcher header, launcher config, RayJob header, [RayJob, NetworkPolicy]), rendered once."""
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for name in GPU_PROFILES:
        launcher, rayjob = render.render(name, "vit_b16_i21k", out, fsx=FSX)
        files[name] = (launcher.read_text(), yaml.safe_load(launcher.read_text()), rayjob.read_text())
        files[name] += (list(yaml.safe_load_all(rayjob.read_text())),)
    return files


def _pods(job: dict) -> dict[str, dict]:
    """Every pod template of a RayJob by role: head, each worker group, the submitter."""
    spec = job["spec"]["rayClusterSpec"]
    pods = {
        "head": spec["headGroupSpec"]["template"],
        **{g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]},
    }
    if "submitterPodTemplate" in job["spec"]:
        pods["submitter"] = job["spec"]["submitterPodTemplate"]
    return pods


def _dockerfile() -> str:
    return render.DOCKERFILE.read_text()


def _dockerfile_line(pattern: str) -> tuple[int, str]:
    """(index, text) of the Dockerfile's first logical line (`\\` continuations joined) matching ``pattern``."""
    lines = re.sub(r"\\\n\s*", " ", _dockerfile()).splitlines()
    return next((i, line) for i, line in enumerate(lines) if re.search(pattern, line))


@pytest.mark.timeout(120)
def test_a100x64_launcher_yaml_validates_with_rays_schema(tmp_path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    launcher, rayjob = render.render("a100x64", "vit_h14_i21k", tmp_path, fsx=FSX)
    config = yaml.safe_load(launcher.read_text())
    validate_config(prepare_config(config))  # Ray's ray-schema.json after Ray fills its defaults; raises if invalid

    types = config["available_node_types"]
    assert types["head"]["node_config"]["InstanceType"] == "p4de.24xlarge"  # the 80 GB A100 part
    assert types["gpu_worker"]["min_workers"] == types["gpu_worker"]["max_workers"] == 7  # head + 7 = 8 nodes
    assert types["head"]["resources"]["GPU"] == types["gpu_worker"]["resources"]["GPU"] == 8
    assert types["eval_worker"]["resources"]["GPU"] == 1  # evals never take a training GPU:
    # their tasks ask for a resource only the eval nodes declare (a restarting worker group leaves GPUs free)
    assert types["eval_worker"]["resources"]["vitscale_eval"] == 1000
    assert "vitscale_eval" not in types["head"]["resources"] | types["gpu_worker"]["resources"]
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "RAY_AUTH_MODE=token" in head_start

    docs = list(yaml.safe_load_all(rayjob.read_text()))
    job, policy = docs
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["entrypoint"] == "python -m cluster.driver"
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert groups["gpu"]["replicas"] == 7
    # `ray start --resources=` through KubeRay's shell: a JSON object, quoted
    assert json.loads(json.loads(groups["eval"]["rayStartParams"]["resources"])) == {"vitscale_eval": 1000}
    assert groups["gpu"]["rayStartParams"] == {}
    head_limits = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    assert head_limits["limits"]["nvidia.com/gpu"] == "8"
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    env = runtime_env["env_vars"]
    spec = json.loads(env["VITSCALE_PLAN"])
    # Shards on s3://: the image holds the s3 extra, and the job installs it too (for an image without it).
    assert runtime_env["pip"] == ["s3fs>=2024.2"] and spec["plan"]["data"]["storage_extras"] == ["s3"]
    assert spec["plan"]["topology"]["world_size"] == 64 and spec["config"]["model"]["name"] == "vit_h14"
    assert spec["config"]["checkpoint"]["dir"].startswith("/fsx/")
    assert policy["kind"] == "NetworkPolicy"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_gpu_profiles_launcher_yaml_passes_rays_validator(rendered, name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = rendered[name][1]
    validate_config(prepare_config(config))  # raises jsonschema.ValidationError (or ValueError) if invalid
    assert (
        config["available_node_types"]["head"]["node_config"]["InstanceType"]
        == render.load_profile(name).hardware.instance_type
    )


def test_dockerfile_builds_on_rays_published_cuda_image():
    """Ray stopped publishing rayproject/ray-ml after 2.49: the base is rayproject/ray's CUDA image of the Ray this
    venv plans and submits with."""
    assert render.RAY_VERSION == importlib.metadata.version("ray")
    assert render.BASE_IMAGE == f"rayproject/ray:{render.RAY_VERSION}-py311-gpu"
    _, arg = _dockerfile_line(r"^ARG RAY_VERSION=")
    _, base = _dockerfile_line(r"^FROM ")
    assert base.split()[1].replace("${RAY_VERSION}", arg.split("=", 1)[1]) == render.BASE_IMAGE
    assert "ray-ml" not in render.BASE_IMAGE + render.IMAGE
    assert render.IMAGE.startswith("registry.example.com/")  # a placeholder no one can pull from


def test_dockerfile_installs_as_make_setup_does():
    """The same torch pin, then DeepSpeed with the same spec and flags, then the project with the extras the GPU
    profiles' storage needs: in the Makefile's order, so the image and a venv cannot drift apart."""
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    torch_pin = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, re.M).group(1)
    ds_make = next(line for line in makefile.splitlines() if "pip install" in line and "deepspeed" in line)
    ds_spec = re.search(r'"(deepspeed[^"]*)"', ds_make).group(1)
    assert "DS_BUILD_OPS=0" in ds_make and "--no-build-isolation" in ds_make  # what the image must repeat

    torch_at, torch_line = _dockerfile_line(r"pip install .*\"torch==")
    _, torch_arg = _dockerfile_line(r"^ARG TORCH_VERSION=")
    assert torch_arg == f"ARG TORCH_VERSION={torch_pin}" and '"torch==${TORCH_VERSION}"' in torch_line
    ds_at, ds_line = _dockerfile_line(r"pip install .*deepspeed")
    assert f'"{ds_spec}"' in ds_line and "DS_BUILD_OPS=0" in ds_line and "--no-build-isolation" in ds_line
    project_at, project_line = _dockerfile_line(r'pip install .*"\.\[')
    assert torch_at < ds_at < project_at
    extras = set(re.search(r'"\.\[([^\]]*)\]"', project_line).group(1).split(","))
    for name in GPU_PROFILES:
        storage = render.load_profile(name).storage
        assert {e.name for e in storage_extras([storage.shards])} <= extras, name
    assert "pip uninstall -y vitscale" in project_line  # dependencies only: the job brings the code
    # make setup's constraints: without them pip backtracks through the object-storage stack (README.md, "Install")
    constraints = re.search(r'pip install -e "\.\[dev\]" (-c \S+)', makefile).group(1)
    assert constraints in project_line, project_line
    assert re.search(rf"^COPY .* {constraints.split()[1]} .*\./$", _dockerfile(), re.M)

    # Every package pip installs, and the recipes and eval suites, are in the image's copy of the code.
    find = re.search(r"^\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*)\]$", PYPROJECT.read_text(), re.M)
    packages = [p.strip(' "*') for p in find.group(1).split(",")]
    for folder in [*packages, "configs"]:
        assert re.search(rf"^COPY .* {folder} {folder}$", _dockerfile(), re.M), folder
    assert _dockerfile_line(r"^WORKDIR ")[1] == f"WORKDIR {render.IMAGE_CODE_DIR}"


@pytest.mark.timeout(120)
def test_every_node_and_pod_runs_the_built_image(rendered, tmp_path, capsys):
    for _, config, _, (job, _) in rendered.values():
        assert config["docker"]["image"] == render.IMAGE
        for role, pod in _pods(job).items():
            assert [c["image"] for c in pod["spec"]["containers"]] == [render.IMAGE], role

    mine = "123456789012.dkr.ecr.us-east-1.amazonaws.com/vitscale:ray2.60.0"
    assert render.main(["--cluster", "a100x8", "--out", str(tmp_path), "--image", mine]) == 0
    config = yaml.safe_load((tmp_path / "a100x8" / "cluster.yaml").read_text())
    job = next(yaml.safe_load_all((tmp_path / "a100x8" / "rayjob.yaml").read_text()))
    assert config["docker"]["image"] == mine
    assert {c["image"] for pod in _pods(job).values() for c in pod["spec"]["containers"]} == {mine}
    assert "placeholder" not in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_fsx_is_mounted_on_the_host_before_the_container_starts(rendered, tmp_path, capsys):
    """Ray runs initialization_commands on the host before `docker run`; setup_commands run in the container, after
    its `-v /fsx:/fsx` bind was made, and unprivileged."""
    config = rendered["a100x64"][1]
    mount = f"sudo mount -t lustre -o relatime,flock {FSX.dns_name}@tcp:/{FSX.mount_name} /fsx"
    assert any(mount in command for command in config["initialization_commands"])
    assert f"-v {render.SHARED_FS}:{render.SHARED_FS}" in config["docker"]["run_options"]
    commands = [c for key, value in config.items() if key.endswith("_commands") for c in value]
    assert not any("lustre" in c for c in commands if c not in config["initialization_commands"])
    assert not any("$FSX" in c for c in commands)  # nothing defines such variables on a node

    # Without the file system's names: the files are written, and `ray up` stops at the mount, saying why.
    profile = render.load_profile("a100x8")
    commands = render.launcher_config(profile, ami="ami-0123456789abcdef0")["initialization_commands"]
    (command,) = [c for c in commands if render.IMDS not in c]  # beside the AMI's root device check
    assert "--fsx-dns" in command and command.endswith("exit 1")
    assert render.main(["--cluster", "a100x8", "--out", str(tmp_path)]) == 0
    assert "--fsx-dns" in capsys.readouterr().out

    bad = [
        ["--fsx-dns", FSX.dns_name],  # one without the other
        ["--fsx-dns", "fs-1.fsx.us-east-1.amazonaws.com; rm -rf /", "--fsx-mount-name", "abc"],
        ["--fsx-dns", FSX.dns_name, "--fsx-mount-name", "a b"],
        ["--fsx-dns", "fs-1.fsx.eu-west-1.amazonaws.com", "--fsx-mount-name", "abc"],  # another region
    ]
    for flags in bad:
        assert render.main(["--cluster", "a100x8", "--out", str(tmp_path / "bad"), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("python -m cluster.render: error: --fsx") and err.count("\n") == 1, err


@pytest.mark.timeout(120)
def test_code_comes_with_the_job_and_no_node_installs_it(rendered):
    for _, config, _, (job, _) in rendered.values():
        commands = [c for key, value in config.items() if key.endswith("_commands") for c in value]
        assert not any("pip install" in c for c in commands)
        assert config["setup_commands"] == []
        runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
        # The image's copy of the code (the submitter pod uploads it), with the env of cluster.launch's jobs
        assert runtime_env["working_dir"] == render.IMAGE_CODE_DIR
        assert runtime_env["env_vars"]["RAY_worker_niceness"] == "0"


@pytest.mark.timeout(120)
def test_every_node_gets_the_clusters_auth_token(rendered):
    header, config, rayjob_header, (job, _) = rendered["a100x64"]
    # Launcher: the token made before `ray up` reaches every node's container, where `ray start` reads it.
    assert config["file_mounts"] == {render.AUTH_TOKEN_FILE: render.AUTH_TOKEN_FILE}
    assert render.AUTH_TOKEN_FILE == "~/.ray/auth_token"  # Ray's default path: no RAY_AUTH_TOKEN_PATH needed
    assert "ray get-auth-token --generate" in header
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = " ".join(config[key])
        assert "RAY_AUTH_MODE=token ray start" in start and "--generate" not in start, key  # no token of its own
    # KubeRay: the secret in every pod that starts Ray or submits to it (KubeRay's default submitter has none).
    assert f"kubectl create secret generic {render.TOKEN_SECRET} " in rayjob_header
    pods = _pods(job)
    assert {"head", "gpu", "eval", "submitter"} <= set(pods)
    for role, pod in pods.items():
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", role
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": render.TOKEN_SECRET, "key": "auth_token"}
        if role != "submitter":  # the driver and every worker log to MLflow, with the namespace's credentials
            mlflow = {k: env[k]["valueFrom"]["secretKeyRef"] for k in render.MLFLOW_SECRET_KEYS}
            assert all(ref == {"name": render.MLFLOW_SECRET, "key": k, "optional": True} for k, ref in mlflow.items())
    assert f"kubectl create secret generic {render.MLFLOW_SECRET} " in rayjob_header


@pytest.mark.timeout(120)
def test_the_kuberay_operator_can_poll_the_jobs_state(rendered):
    """KubeRay's operator polls the head's Jobs API for the job's state, from its own namespace, with the token only
    where the RayCluster's authOptions name it (its dashboard client sends none otherwise: the head refuses every poll
    and the RayJob never finishes)."""
    _, _, rayjob_header, (job, policy) = rendered["a100x64"]
    assert job["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token", "secretName": render.TOKEN_SECRET}
    assert "--from-literal=auth_token=" in rayjob_header and "KubeRay operator 1.6 or later" in rayjob_header
    # An operator upgraded with `helm upgrade` keeps the CRDs it had: kubectl then refuses the file's secretName
    assert "KubeRay operator 1.6 or later and its CRDs" in rayjob_header
    assert 'kubectl replace -k "github.com/ray-project/kuberay/ray-operator/config/crd?ref=v1.6.0"' in rayjob_header
    namespace, operator = policy["spec"]["ingress"]
    assert namespace == {"from": [{"podSelector": {}}]}
    # Helm's chart and the kustomize manifests both label the operator's pod so, in whatever namespace it runs
    assert operator["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}}}
    ]
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
    assert "dashboard-port" not in head  # Ray's 8265, the port the policy opens


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", GPU_PROFILES)
def test_placement_group_exists_before_ray_up(rendered, name):
    """Ray's AWS provider passes node_config's Placement to EC2 as it is: the group is never created for us. Every
    training node (the head trains too) is in one, created by the command the file's header gives."""
    header, config, _, _ = rendered[name]
    types = config["available_node_types"]
    training = [t["node_config"] for key, t in types.items() if key != "eval_worker"]
    groups = {node.get("Placement", {}).get("GroupName") for node in training}
    if render.load_profile(name).hardware.nodes == 1:
        assert groups == {None} and "create-placement-group" not in header  # one node: nothing to place
        return
    (group,) = groups
    region = config["provider"]["region"]
    assert f"aws ec2 create-placement-group --region {region} --group-name {group} --strategy cluster" in header


def _gib(quantity: str) -> float:
    return float(quantity.removesuffix("Gi"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_pod_fits_its_node_and_holds_its_ray_work(rendered, name):
    """A pod asking for a whole node is never scheduled (the kubelet and the daemonsets keep part of it); and the
    smaller pod must still hold the Ray work meant for it: a node's training workers, an eval task."""
    profile = render.load_profile(name)
    hw, wk, ev = profile.hardware, profile.workers, profile.evals
    job = rendered[name][3][0]
    nodes = {"head": (hw.cpus_per_node, hw.memory_gb_per_node), "gpu": (hw.cpus_per_node, hw.memory_gb_per_node)}
    if ev.instance_type:
        nodes["eval"] = render.EVAL_INSTANCES[ev.instance_type][:2]
    pods = _pods(job)
    for role, (vcpus, memory_gb) in nodes.items():
        requests = pods[role]["spec"]["containers"][0]["resources"]["requests"]
        assert int(requests["cpu"]) <= vcpus - 1 and _gib(requests["memory"]) <= 0.95 * memory_gb, (role, requests)
        assert requests == pods[role]["spec"]["containers"][0]["resources"]["limits"]
    training_cpus = wk.max_workers // hw.nodes * wk.cpus_per_worker
    head = pods["head"]["spec"]["containers"][0]["resources"]["requests"]
    assert int(head["cpu"]) >= training_cpus + (0 if ev.instance_type else ev.num_cpus)
    if ev.instance_type:
        evals = pods["eval"]["spec"]["containers"][0]["resources"]["requests"]
        assert int(evals["cpu"]) >= ev.num_cpus and int(evals.get("nvidia.com/gpu", 0)) >= ev.num_gpus
        assert "vpc.amazonaws.com/efa" not in evals  # a g5.2xlarge has no EFA device to give


@pytest.mark.timeout(120)
def test_render_refuses_an_eval_that_cannot_fit_its_pod(tmp_path, capsys):
    data = yaml.safe_load((render.load_profile.__globals__["PROFILES_DIR"] / "a100x64.yaml").read_text())
    data["evals"]["num_cpus"] = 8  # all of a g5.2xlarge's vCPUs
    (tmp_path / "big_eval.yaml").write_text(yaml.safe_dump(data))
    assert render.main(["--cluster", str(tmp_path / "big_eval.yaml"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "evals.num_cpus=8" in err and err.count("\n") == 1
    data["evals"]["instance_type"] = "x9.mega"
    (tmp_path / "unknown.yaml").write_text(yaml.safe_dump(data))
    assert render.main(["--cluster", str(tmp_path / "unknown.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "EVAL_INSTANCES" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "section,key,value,message",
    [
        ("hardware", "instance_type", None, r"hardware\.instance_type is empty; set e\.g\. p4de\.24xlarge"),
        ("storage", "checkpoints", "s3://bucket/runs", r"storage\.checkpoints='s3://bucket/runs' must live on .* /fsx"),
        ("storage", "checkpoints", "/fsxdata/runs", r"storage\.checkpoints='/fsxdata/runs' must live on .* /fsx"),
        ("storage", "shared", "/lustre", r"storage\.shared='/lustre': the files mount FSx at /fsx"),
        ("workers", "cpus_per_worker", 20, r"need 160 CPUs, its pod has 94 of hardware\.cpus_per_node=96; lower"),
    ],
    ids=["no-instance-type", "checkpoints-off-fsx", "beside-fsx", "shared-elsewhere", "workers-over-the-pod"],
)
def test_render_refuses_a_profile_its_nodes_cannot_run(tmp_path, capsys, section, key, value, message):
    """A lab's own profile: what `ray up` or KubeRay would fail on later is refused here, in one line."""
    data = yaml.safe_load((render.load_profile.__globals__["PROFILES_DIR"] / "a100x64.yaml").read_text())
    if value is None:
        del data[section][key]
    else:
        data[section][key] = value
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump(data))
    assert render.main(["--cluster", str(tmp_path / "lab.yaml"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_run_name_names_the_run_folder_and_a_rayjob_kuberay_takes(tmp_path, capsys):
    """`--run-name` renders a second run of a profile; the RayJob's name is the run's as KubeRay takes it (a DNS-1035
    label of at most 47 characters), and a name it would refuse at `kubectl apply` is refused here, nothing written."""
    assert render.main(["--cluster", "a100x8", "--run-name", "ViT.B16_try2", "--out", str(tmp_path / "out")]) == 0
    header = (tmp_path / "out" / "a100x8" / "rayjob.yaml").read_text()
    rayjob, policy = yaml.safe_load_all(header)
    assert rayjob["metadata"]["name"] == "vit-b16-try2" and policy["metadata"]["name"] == "vit-b16-try2-jobs-api"
    spec = json.loads(yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]["VITSCALE_PLAN"])
    run_dir = spec["config"]["checkpoint"]["dir"]
    assert run_dir.endswith("/ViT.B16_try2") and f"run folder {run_dir}" in header
    capsys.readouterr()
    for name, message in (
        ("9lives", r"RayJob name '9lives' .*a letter first"),
        ("vit-b16-" + "x" * 40, r"48 characters\): KubeRay takes at most 47"),
        ("my run", r"RayJob name 'my run' .*letters, digits and '-'"),
    ):
        assert render.main(["--cluster", "a100x8", "--run-name", name, "--out", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err) and err.count("\n") == 1 and "--run-name" in err, err
        assert not (tmp_path / name).exists()


@pytest.mark.timeout(60)
def test_render_refuses_the_local_profile(capsys):
    with pytest.raises(ValueError, match="needs no cluster files"):
        render.launcher_config(render.load_profile("local"))
    assert render.main(["--cluster", "local"]) == 2
    assert render.main(["--cluster", "nope"]) == 2
    assert "valid profiles" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_gcs_shards_install_the_gcs_extra(tmp_path, monkeypatch):
    from ray.autoscaler._private.util import prepare_config, validate_config

    # No bucket answers here: the plan goes on with its assumptions after MANIFEST_WAIT_S (tests/cluster/test_plan.py)
    monkeypatch.setattr("cluster.plan.storage.MANIFEST_WAIT_S", 1.0)

    data = yaml.safe_load((render.load_profile.__globals__["PROFILES_DIR"] / "a100x8.yaml").read_text())
    data["storage"]["shards"] = "gs://vitscale-datasets"
    profile = tmp_path / "a100x8_gcs.yaml"
    profile.write_text(yaml.safe_dump(data))
    launcher, rayjob = render.render(str(profile), "vit_b16_i21k", tmp_path / "out", fsx=FSX)
    config = yaml.safe_load(launcher.read_text())
    validate_config(prepare_config(config))
    job = next(yaml.safe_load_all(rayjob.read_text()))
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env["pip"] == ["gcsfs>=2024.2"]  # the image holds s3 only: the job installs gcs
    assert json.loads(runtime_env["env_vars"]["VITSCALE_PLAN"])["config"]["data"]["train"].startswith("gs://")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "key,value,message",
    [
        ("workers.cpus_per_worker", 20, "need 160 CPUs, its pod has 94 of hardware.cpus_per_node=96"),
        ("evals.num_gpus", 2, "num_gpus=2) does not fit the g5.2xlarge pod (7 of its 8 vCPUs, 1 GPU)"),
    ],
)
def test_launch_and_preflight_refuse_what_render_refuses(tmp_path, capsys, key, value, message):
    """A node or an eval pod that cannot hold its work: the dry run, the preflight and render say the same line."""
    from cluster import launch
    from cluster.preflight import __main__ as preflight

    data = yaml.safe_load((render.load_profile.__globals__["PROFILES_DIR"] / "a100x64.yaml").read_text())
    section, field = key.split(".")
    data[section][field] = value
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump(data))
    lab = str(tmp_path / "lab.yaml")
    assert render.main(["--cluster", lab, "--out", str(tmp_path / "out")]) == 2
    refused = capsys.readouterr().err
    assert message in refused and refused.count("\n") == 1, refused
    said = refused.removeprefix("python -m cluster.render: error: ")  # each names itself
    assert launch.main(["--cluster", lab, "--dry-run"]) == 2
    assert capsys.readouterr().err == f"python -m cluster.launch: error: {said}"
    assert preflight.main(["--cluster", lab]) == 2
    assert capsys.readouterr().err == f"python -m cluster.preflight: error: {said}"


@pytest.mark.timeout(60)
def test_render_names_the_local_profile_given_and_refuses_an_image_with_spaces(tmp_path, capsys):
    assert render.main(["--cluster", "local_elastic"]) == 2
    assert "profile local_elastic runs on this machine" in capsys.readouterr().err
    out = tmp_path / "out"
    assert render.main(["--cluster", "a100x8", "--image", "bad image", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--image 'bad image' is no image reference" in err and err.count("\n") == 1 and not out.exists(), err


@pytest.mark.timeout(120)
def test_efa_reaches_the_training_containers_of_a_multi_node_efa_profile(tmp_path, capsys):
    """EFA interfaces on every training node (as Ray's AWS bootstrap reads them), their devices in the container;
    none for evals or one-node profiles; without a subnet `ray up` stops rather than train over TCP."""
    import copy

    from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces
    from ray.autoscaler._private.util import prepare_config, validate_config

    subnet, group = "subnet-0123456789abcdef0", "sg-0123456789abcdef0"
    launcher, rayjob = render.render("a100x64", "vit_h14_i21k", tmp_path, fsx=FSX, efa=render.efa_subnet(subnet, group))
    config = yaml.safe_load(launcher.read_text())
    validate_config(prepare_config(config))
    # No public IP for an instance of several interfaces (EC2): `ray up` waited for the head's forever, and Ray's
    # subnet check refused a private subnet.
    assert (
        config["provider"]["use_internal_ips"] is True and "from a machine in that subnet's VPC" in launcher.read_text()
    )
    types = config["available_node_types"]
    for name in ("head", "gpu_worker"):
        node = types[name]["node_config"]
        cards = [(i["NetworkCardIndex"], i["DeviceIndex"], i["InterfaceType"]) for i in node["NetworkInterfaces"]]
        assert cards == [(0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa"), (3, 1, "efa")]  # p4de.24xlarge: 4 x 100 Gb/s
        ec2 = _configure_subnets_and_groups_from_network_interfaces(copy.deepcopy(node))
        assert ec2["SubnetIds"] == [subnet] * 4 and ec2["SecurityGroupIds"] == [group] * 4
    devices = ["--ulimit memlock=-1:-1", *(f"--device=/dev/infiniband/uverbs{i}" for i in range(4))]
    assert config["docker"]["head_run_options"] == types["gpu_worker"]["docker"]["worker_run_options"] == devices
    assert "docker" not in types["eval_worker"] and "NetworkInterfaces" not in types["eval_worker"]["node_config"]
    assert not any("EFA interface" in c for c in config["initialization_commands"])
    pods = _pods(list(yaml.safe_load_all(rayjob.read_text()))[0])
    assert [p["spec"]["containers"][0]["resources"]["limits"].get("vpc.amazonaws.com/efa") for p in pods.values()] == [
        "4",
        "4",
        None,
        None,
    ]  # head, gpu, eval, submitter
    # Each Ray pod on its own instance type: an eval pod on a p4de node would hold a GPU a training pod waits for.
    selectors = [p["spec"].get("nodeSelector", {}).get("node.kubernetes.io/instance-type") for p in pods.values()]
    assert selectors == ["p4de.24xlarge", "p4de.24xlarge", "g5.2xlarge", None]

    assert render.main(["--cluster", "a100x64", "--out", str(tmp_path / "bare")]) == 0
    assert "note: no --subnet-id/--security-group-id: `ray up` of cluster.yaml stops" in capsys.readouterr().out
    bare = yaml.safe_load((tmp_path / "bare" / "a100x64" / "cluster.yaml").read_text())
    assert "NetworkInterfaces" not in bare["available_node_types"]["head"]["node_config"]
    assert "use_internal_ips" not in bare["provider"]
    assert bare["initialization_commands"][-1].endswith("--subnet-id and --security-group-id' >&2; exit 1")
    for bad, message in (
        (["--subnet-id", subnet], "go together"),
        (["--subnet-id", "subnet-12", "--security-group-id", group], "--subnet-id 'subnet-12': give an EC2 id"),
    ):
        assert render.main(["--cluster", "a100x64", "--out", str(tmp_path / "x"), *bad]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "x").exists()
    one_node = render.render("h100x8", "vit_b16_i21k", tmp_path / "one", fsx=FSX)
    assert "head_run_options" not in yaml.safe_load(one_node[0].read_text())["docker"]
    assert "vpc.amazonaws.com/efa" not in one_node[1].read_text()  # NVLink within the node: no EFA to wait for


@pytest.mark.timeout(120)
def test_the_rayjobs_job_is_one_make_status_logs_and_stop_count(rendered):
    """KubeRay's submitter passes the RayJob's spec.metadata to `ray job submit --metadata-json`; `make status`, `make
    logs` and `make stop` (port-forwarded to the head) count only jobs with this project's metadata, so a RayJob
    without it ran a job they listed as "no vitscale jobs" and could not stop."""
    from cluster import jobs

    for name, (_, _, _, (job, _)) in rendered.items():
        metadata = job["spec"]["metadata"]
        assert metadata == jobs.JOB_METADATA, name
        assert all(isinstance(v, str) for v in metadata.values()), name  # KubeRay's map[string]string


@pytest.mark.timeout(120)
def test_the_rayjob_says_its_courier_dies_with_the_cluster_and_what_sends_its_records_then(rendered):
    """KubeRay deletes the RayJob's cluster an hour after the job, and the MLflow courier (which waits up to 24 h for
    a server down at the job's end) with it: every pod tells the job's end so, and the header names the command."""
    from cluster.driver.courier import CLUSTER_TTL_ENV

    _, _, rayjob_header, (job, _) = rendered["a100x64"]
    ttl = job["spec"]["ttlSecondsAfterFinished"]
    assert job["spec"]["shutdownAfterJobFinishes"] and ttl == render.CLUSTER_TTL_S
    for role, pod in _pods(job).items():
        if role != "submitter":  # the driver runs on the head, a courier on any Ray node
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
            assert env[CLUSTER_TTL_ENV] == str(ttl), role
    run_dir = re.search(r"run folder (\S+) ", rayjob_header).group(1)
    assert f"#   python -m cluster.driver.deliver {run_dir}\n" in rayjob_header


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_eval_node_is_labelled_and_the_ranks_selector_keeps_off_it_only(monkeypatch, tmp_path):
    """A g5.4xlarge eval node holds an A100 worker's bundle: Ray Train could put a rank on its 24 GB A10G. Both files
    label the eval node (as Ray reads them); the driver's selector, on a real 2-node cluster, places bundles on the
    unlabelled node (a lab's own nodes have no label) and never on the labelled one, though it has room."""
    import logging
    import tempfile

    import ray
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_labels_from_group_spec
    from ray.autoscaler._private.util import prepare_config, validate_config
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from cluster import local_head
    from cluster.driver.job import _torch_trainer, eval_cadence
    from cluster.elastic_demo import NODE_ARGS
    from cluster.profiles import EVAL_NODE_LABELS

    profile = render.load_profile("a100x64")
    launcher, rayjob = render.render("a100x64", "vit_h14_i21k", tmp_path, fsx=FSX)
    config = yaml.safe_load(launcher.read_text())
    validate_config(prepare_config(config))
    labels = {name: t.get("labels") for name, t in config["available_node_types"].items()}
    assert labels == {"head": None, "gpu_worker": None, "eval_worker": EVAL_NODE_LABELS}
    groups = next(yaml.safe_load_all(rayjob.read_text()))["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert {g["groupName"]: _get_labels_from_group_spec(g, g["groupName"]) for g in groups} == {
        "gpu": {},
        "eval": EVAL_NODE_LABELS,
    }

    config = render.resolve_config(profile, "vit_h14_i21k", [], "r")
    spec = render.JobSpec.create(profile, config, render.build_plan(profile, config))
    scaling = _torch_trainer(spec, config, None, eval_cadence(spec), 0.0).scaling_config  # the driver's
    selector = scaling.label_selector
    assert selector and scaling._label_selector_per_worker(2) == [selector] * 2  # what Ray Train's placement group gets
    assert render.load_profile("local").training_label_selector is None  # no eval node group: no selector
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    temp_dir = tempfile.mkdtemp(prefix="vsl", dir="/tmp")
    lean = dict(no_monitor=True, include_log_monitor=False, _system_config={"prestart_worker_first_driver": False})
    with local_head.ray_auth_mode("disabled"):
        cluster = local_head.in_process_cluster(**NODE_ARGS, **lean, num_cpus=2, temp_dir=temp_dir)
        try:
            node = cluster.add_node(**NODE_ARGS, num_cpus=2, labels=EVAL_NODE_LABELS, temp_dir=temp_dir)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
            two = placement_group([{"CPU": 1}] * 2, strategy="PACK", bundle_label_selector=[selector] * 2)
            assert two.wait(30)
            placed = set(placement_group_table(two)["bundles_to_node_id"].values())
            assert len(placed) == 1 and node.node_id not in placed  # the unlabelled head's
            remove_placement_group(two)
            three = placement_group([{"CPU": 1}] * 3, strategy="PACK", bundle_label_selector=[selector] * 3)
            assert not three.wait(3)  # the eval node's 2 free CPUs are not for ranks
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
