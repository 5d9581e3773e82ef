"""The path from `make launch CLUSTER=<gpu profile>` to the first GPU step that no CPU run takes: the files
`cluster.render` writes for `ray up`, checked with Ray's own code."""

from __future__ import annotations

import copy
import http.server
import json
import socket
import threading
from pathlib import Path

import pytest
import yaml

from cluster import launch, render

FSX = render.FsxMount("fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", "abcdefgh")
AMI = "ami-0123456789abcdef0"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["a100x64", "h100x8"])
def test_every_node_boots_the_ami_given_never_rays_default(tmp_path, capsys, name):
    """Ray's AWS provider gives a node_config without ImageId its DEFAULT_AMI, a Deep Learning AMI (Ubuntu 18.04) of
    2023 with a CUDA 11 driver: no H100/H200, no CUDA 12 image. Every node type (evals too) boots --ami-id; without it
    `ray up` stops, saying why, before any container starts."""
    from ray.autoscaler._private.aws.config import DEFAULT_AMI, _check_ami
    from ray.autoscaler._private.util import prepare_config, validate_config

    out = tmp_path / "given"
    assert render.main(["--cluster", name, "--out", str(out), "--ami-id", AMI]) == 0
    config = yaml.safe_load((out / name / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    _check_ami(checked := copy.deepcopy(config))
    images = {key: t["node_config"].get("ImageId") for key, t in checked["available_node_types"].items()}
    assert set(images.values()) == {AMI} and DEFAULT_AMI[render.REGION] not in images.values(), images
    assert not any("--ami-id" in c for c in config["initialization_commands"])
    assert "--ami-id" not in capsys.readouterr().out

    assert render.main(["--cluster", name, "--out", str(tmp_path / "bare")]) == 0
    assert "note: no --ami-id: `ray up` of cluster.yaml stops" in capsys.readouterr().out
    bare = yaml.safe_load((tmp_path / "bare" / name / "cluster.yaml").read_text())
    stop = bare["initialization_commands"][0]  # before the FSx mount: the default AMI may lack the Lustre client
    assert "--ami-id" in stop and stop.endswith("exit 1")
    assert "ImageId" not in bare["available_node_types"]["head"]["node_config"]
    header = (tmp_path / "bare" / name / "cluster.yaml").read_text().split("\n\n")[0]
    assert "--ami-id" in header

    for bad in ("ami-12", "ami-0123456789ABCDEF0", "latest_dlami", "ami-01234567; rm -rf /"):
        assert render.main(["--cluster", name, "--out", str(tmp_path / "x"), "--ami-id", bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("python -m cluster.render: error: --ami-id") and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()


def test_launcher_config_with_every_host_need_given_stops_nothing():
    config = render.launcher_config(
        render.load_profile("a100x64"),
        fsx=FSX,
        efa=render.efa_subnet("subnet-0123456789abcdef0", "sg-0123456789abcdef0"),
        ami=render.ami_id(AMI),
    )
    assert not any("exit 1" in c for c in config["initialization_commands"])


class _Quiet(http.server.BaseHTTPRequestHandler):
    """A fake server's handler: answers with a body, logs nothing."""

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Ingress(_Quiet):
    """A proxy in front of a cluster's Jobs API: it passes Ray's version check and refuses the working_dir upload, as
    ingress-nginx does with its 1 MiB default body limit (413), or drops the connection (a `ray dashboard` tunnel that
    closed)."""

    drop = False

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.startswith("/api/packages/"):  # Ray asks whether the package is there before uploading it
            return self._answer(404, b"")
        if self.path.rstrip("/") == "/api/jobs":  # the launch looks for a job of the run still running: none
            return self._answer(200, b"[]")
        self._answer(200, json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}).encode())

    def do_PUT(self):  # noqa: N802
        if self.drop:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        title = b"413 Request Entity Too Large"  # nginx's page
        page = b"<html>\r\n<head><title>%s</title></head>\r\n<body><center><h1>%s</h1></center>\r\n" % (title, title)
        self._answer(413, page + b"<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("drop", [False, True], ids=["body-limit", "dropped"])
def test_a_jobs_api_that_refuses_the_upload_is_one_line_not_a_traceback(monkeypatch, capsys, drop):
    """`make launch CLUSTER=a100x64` through a proxy that refuses the job's upload (the checkout, a few MiB) or a
    connection that drops during it: one line saying what failed, exit 2, nothing said to be submitted."""
    handler = type("Ingress", (_Ingress,), {"drop": drop})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        status = launch.main(["--cluster", "a100x64", "--recipe", "vit_b16_i21k", "--no-follow"])
    finally:
        server.shutdown()
        server.server_close()
    captured = capsys.readouterr()
    assert status == 2 and "submitted Ray job" not in captured.out
    (line,) = [line for line in captured.err.splitlines() if line.startswith("python -m cluster.launch")]
    assert line.startswith("python -m cluster.launch: error: submitting job vitscale-vit_b16_i21k-"), line
    assert "Traceback" not in captured.err and "<" not in line
    if drop:
        assert "ConnectionError" in line or "Connection" in line, line
    else:
        assert "status code 413: 413 Request Entity Too Large" in line and "nginx; a proxy" in line, line
        assert "proxy-body-size" in line, line


class _Imds(_Quiet):
    """EC2's instance metadata service (IMDSv2: a token first) of a node booted from an AMI whose root is `root`."""

    root = "/dev/sda1"

    def do_PUT(self):  # noqa: N802 (http.server's name)
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._answer(200 if ok else 400, b"tok")

    def do_GET(self):  # noqa: N802
        ok = self.path == "/latest/meta-data/block-device-mapping/root" and self.headers["X-aws-ec2-metadata-token"]
        self._answer(200 if ok == "tok" else 401, self.root.encode())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("root", ["/dev/sda1", "/dev/xvda"])
def test_ray_up_stops_where_the_amis_root_is_not_the_device_given_500_gb(root):
    """`--ami-id` takes any AMI, and the training nodes' 500 GB root go to /dev/sda1, an Ubuntu AMI's root device: an
    AMI booting from /dev/xvda (Amazon Linux, many custom AMIs) keeps its small root, which the image, Ray's logs and
    spills fill, beside an unused 500 GB volume. The host command before the FSx mount stops `ray up`, saying why."""
    import subprocess

    config = render.launcher_config(
        render.load_profile("a100x64"),
        fsx=FSX,
        efa=render.efa_subnet("subnet-0123456789abcdef0", "sg-0123456789abcdef0"),
        ami=render.ami_id(AMI),
    )
    for node_type in ("head", "gpu_worker"):
        (mapping,) = config["available_node_types"][node_type]["node_config"]["BlockDeviceMappings"]
        assert mapping["DeviceName"] == "/dev/sda1" and mapping["Ebs"]["VolumeSize"] == 500
    (check,) = [c for c in config["initialization_commands"] if render.IMDS in c]
    assert (
        config["initialization_commands"].index(check)
        < [i for i, c in enumerate(config["initialization_commands"]) if "mount -t lustre" in c][0]
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Imds", (_Imds,), {"root": root}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        command = check.replace(render.IMDS, f"http://127.0.0.1:{server.server_address[1]}/latest")
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    if root == "/dev/sda1":
        assert done.returncode == 0 and not done.stderr, done.stderr
    else:
        assert done.returncode != 0
        assert "the AMI boots from /dev/xvda, and cluster.yaml gives /dev/sda1" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1


def _local_profile(tmp_path) -> Path:
    """local.yaml with a Ray temp dir and run folders of the test's own."""
    text = (render.PROJECT_ROOT / "cluster" / "profiles" / "local.yaml").read_text()
    text = text.replace("{project}/.ray-local", str(tmp_path / "ray")).replace("{project}/runs", str(tmp_path / "runs"))
    (tmp_path / "ray").mkdir()
    path = tmp_path / "local_by_hand.yaml"
    path.write_text(text.replace("name: local\n", "name: local_by_hand\n"))
    return path


class _Dashboard(_Quiet):
    """A Ray head's dashboard: /api/version names its session."""

    session = ""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"version": "4", "ray_version": "2.60.0", "session_name": self.session}).encode()
        self._answer(200 if self.path == "/api/version" else 404, body)


@pytest.mark.timeout(120)
def test_the_driver_run_by_hand_joins_the_profiles_local_head_not_any_ray(tmp_path, monkeypatch, capsys):
    """`python -m cluster.driver --cluster local` by hand: Ray's "auto" finds no address file for a head started with
    its own temp dir and takes whatever Ray runs on the machine (another project's head, a colleague's), and it would
    connect without the head's token. The driver joins the head recorded in the profile's head.json, in its auth mode;
    none running is one line naming it."""
    from cluster.driver import __main__ as driver
    from cluster.driver.job import JobSpec
    from cluster.local_head import STATE_FILE, HeadInfo
    from cluster.plan.planner import build_plan, resolve_run
    from cluster.profiles import load_profile

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = _local_profile(tmp_path)
    assert driver.main(["--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            "python -m cluster.driver: error: no Ray cluster (no Ray head of this project is running "
            "for profile local_by_hand"
        )
        and err.count("\n") == 1
    ), err

    profile = load_profile(path)
    config, _, _ = resolve_run(profile, "local_demo", [], "by-hand")
    spec = JobSpec.create(profile, config, build_plan(profile, config))
    session = tmp_path / "ray" / "session_2026-12-07_00-00-00_000000_1"
    session.mkdir()
    (tmp_path / "ray" / "session_latest").symlink_to(session)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("D", (_Dashboard,), {"session": session.name}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    head = HeadInfo(
        "127.0.0.1:40123", f"http://127.0.0.1:{server.server_address[1]}", str(tmp_path / "ray"), "token", True
    )
    (tmp_path / "ray" / STATE_FILE).write_text(json.dumps(head.__dict__))
    try:
        assert driver.ray_address(None, spec) == ("127.0.0.1:40123", "token")
        assert driver.own_ray_env("127.0.0.1:40123") == {"env_vars": {"RAY_ADDRESS": "127.0.0.1:40123"}}
        assert driver.own_ray_env("auto") is None  # a Ray job: `launch.runtime_env` gave it the head's
        assert driver.ray_address("10.0.0.1:6379", spec) == ("10.0.0.1:6379", None)
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")  # a Ray job's: Ray resolves it
        assert driver.ray_address(None, spec) == ("auto", None)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(120)
def test_every_node_type_joins_the_given_subnet_and_security_group():
    """The eval node too: without them Ray's AWS setup picked it a subnet and made it a group the head's does not
    let in, so it never joined and no eval ran. Ray's own setup, as far as it runs without AWS, keeps them."""
    from ray.autoscaler._private.aws import config as aws
    from ray.autoscaler._private.util import prepare_config, validate_config

    subnet, group = "subnet-0123abcd", "sg-0123abcd"
    efa = render.efa_subnet(subnet, group)
    config = prepare_config(render.launcher_config(render.load_profile("a100x64"), fsx=FSX, efa=efa, ami=AMI))
    validate_config(config)
    config = aws._configure_from_network_interfaces(copy.deepcopy(config))
    types = config["available_node_types"]
    assert set(types) == {"head", "gpu_worker", "eval_worker"}
    for name, node_type in types.items():
        node = node_type["node_config"]
        assert set(node.get("SubnetIds", [])) == {subnet} and set(node.get("SecurityGroupIds", [])) == {group}, name
    assert aws._configure_security_group(copy.deepcopy(config)) == config  # makes no group: every node type has one


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "setting",
    [
        "checkpoint.dir=/tmp/runs/x",
        "logging.mlflow_tracking_uri=sqlite:////tmp/mlflow.db",
    ],
)
def test_a_multi_node_run_refuses_a_path_each_node_would_have_its_own_copy_of(capsys, setting):
    """Each node wrote and read its own folder: a resume found nothing, the eval node no checkpoint, MLflow forked.
    Inputs (data, weights) may be copied to every node's disk, and are left as given."""
    assert launch.main(["--cluster", "a100x64", "--dry-run", "--set", setting]) == 2
    err = capsys.readouterr().err
    key, value = setting.split("=", 1)
    assert err.startswith(f"python -m cluster.launch: error: {key}={value!r} would be each node's own copy"), err
    assert "share only /fsx (storage.shared) and s3://vitscale-datasets (storage.shards); give " in err
    assert err.count("\n") == 1
    assert launch.main(["--cluster", "a100x64", "--dry-run", "--set", "evals.data_root=/data/vtab"]) == 0


@pytest.mark.timeout(120)
def test_run_folder_paths_under_runs_move_to_the_shared_checkpoints_as_the_recipes_do():
    """`runs/...` is where the recipes' run folders live; on several nodes it goes under storage.checkpoints, as
    `data/...` goes under storage.shards, on one remote node too. Shared paths stay; `local` keeps them as given."""
    from cluster.plan.planner import resolve_config
    from cluster.profiles import load_profile

    sets = ["checkpoint.dir=runs/x", "data.train=/fsx/i21k/train", "logging.mlflow_tracking_uri=sqlite:////fsx/m.db"]
    config = resolve_config(load_profile("a100x64"), "vit_h14_i21k", sets, "r")
    assert config.checkpoint.dir == "/fsx/vitscale/runs/x" and config.data.train == "/fsx/i21k/train"
    assert config.logging.mlflow_tracking_uri == "sqlite:////fsx/m.db"
    assert (
        resolve_config(load_profile("local"), "local_demo", ["checkpoint.dir=runs/x"], "r").checkpoint.dir == "runs/x"
    )
    one_node = resolve_config(load_profile("a100x8"), "vit_b16_i21k", ["checkpoint.dir=runs/x"], "r")
    assert one_node.checkpoint.dir == "/fsx/vitscale/runs/x"  # not the job's working folder, which Ray deletes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["checkpoint.dir=x/y", "logging.mlflow_tracking_uri=sqlite:///mlflow.db"])
def test_a_one_node_remote_run_refuses_a_relative_run_folder_or_store(capsys, setting):
    """On a100x8 a relative run folder or SQLite store was written in the Ray job's working folder, a copy of the
    project that Ray deletes; an absolute path on its one node is kept."""
    assert launch.main(["--cluster", "a100x8", "--dry-run", "--set", setting]) == 2
    key, value = setting.split("=", 1)
    err = capsys.readouterr().err
    assert err.startswith(f"python -m cluster.launch: error: {key}={value!r} is relative: the job would write it in ")
    assert launch.main(["--cluster", "a100x8", "--dry-run", "--set", "checkpoint.dir=/nvme/runs/x"]) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["launch", "preflight", "jobs"])
def test_a_ray_address_ray_cannot_parse_names_the_form_it_takes(monkeypatch, capsys, entry):
    """`RAY_ADDRESS=garbage` said only Ray's "Invalid address format: garbage", with no fix (`make launch`,
    `make preflight`, `make status/logs/stop`)."""
    from cluster import jobs
    from cluster.preflight import __main__ as preflight

    monkeypatch.setenv("RAY_ADDRESS", "garbage")
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    main = {"launch": launch.main, "preflight": preflight.main, "jobs": jobs.main}[entry]
    assert main(["status", "--cluster", "h100x8"] if entry == "jobs" else ["--cluster", "h100x8"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"python -m cluster.{entry}: error: RAY_ADDRESS='garbage' is no address Ray takes (Invalid address format: "
        "garbage); give the head's Jobs API, http://HEAD:8265 (its dashboard port), or ray://HEAD:10001\n"
    )
