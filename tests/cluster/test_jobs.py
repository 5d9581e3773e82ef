"""cluster.jobs + cluster.local_head + cluster.env: unreachable clusters, and the embedded head (token auth) through
its life: submit, status, logs, Ray's own CLI (`ray job list|logs|submit` with the exports `make env` prints), stop."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import env as cluster_env
from cluster import jobs, launch, local_head, profiles, render
from cluster.local_head import free_port
from cluster.preflight import __main__ as preflight
from cluster.profiles import load_profile
from tests.support.load import cpu_burners

ROOT = Path(__file__).resolve().parents[2]
RAY_VARS = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def test_free_ports_are_drawn_below_the_kernels_range_for_outgoing_connections():
    """Ports for Ray's head: free when drawn, and out of the range where any process's outgoing connection may take
    one between the draw and Ray's bind (a head failed to start so in the suite)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(local_head.PORTS_FROM <= port < low for port in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


@pytest.mark.timeout(120)
def test_unreachable_ray_address_says_how_to_start_the_cluster(monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(jobs.RayUnreachableError) as info:
        jobs.connect(load_profile("a100x64"))
    msg = str(info.value)
    assert "cannot reach the Ray Jobs API of profile a100x64" in msg and "RAY_ADDRESS" in msg
    assert "`ray up rendered/a100x64/cluster.yaml`" in msg and "`ray dashboard rendered/a100x64/cluster.yaml`" in msg
    assert "`kubectl apply -f rendered/a100x64/rayjob.yaml` runs the job itself, without a launch" in msg
    # The launcher prints the plan, then fails before submitting anything.
    assert launch.main(["--cluster", "a100x64", "--recipe", "vit_b16_i21k"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("plan: recipe vit_b16_i21k") and "submitted" not in captured.out
    assert "cannot reach" in captured.err
    # So does the preflight, after the recipe's settings that replace the profile's (as the launch prints them).
    assert preflight.main(["--cluster", "h100x8"]) == 2
    captured = capsys.readouterr()
    assert "note: the recipe's deepspeed.zero_stage=2 replaces profile h100x8's 1; --set deepspeed.zero_stage=1" in (
        captured.out
    )
    assert "cannot reach the Ray Jobs API of profile h100x8" in captured.err


@pytest.mark.timeout(60)
def test_a_jobs_api_that_fails_its_calls_is_one_line(monkeypatch, capsys):
    """A head that answers its version, then fails the job list (a 500, a dropped connection): `make status`, `make
    logs` and `make stop` ended in a RuntimeError or ConnectionError traceback, exit 1."""
    import http.server

    class Head(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/api/version"):
                body = {"version": "4", "ray_version": "2.60.0", "ray_commit": "x", "session_name": "s"}
                self.send_response(200)
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())
            elif self.server.drop:
                self.connection.close()
            else:
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b"database locked")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Head)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{server.server_port}")
    try:
        for server.drop in (False, True):
            for verb in ("status", "logs", "stop"):
                assert jobs.main([verb, "--cluster", "a100x8"]) == 2
                err = capsys.readouterr().err
                assert err.startswith("python -m cluster.jobs: error: the Ray Jobs API of profile a100x8 failed a ")
                assert err.count("\n") == 1 and ("500" in err or "aborted" in err.lower()), err
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_stop_names_the_run_folders_whose_courier_had_work_left(tmp_path):
    """`make stop` ends the local head and with it a job's MLflow courier (a detached actor there): each run folder
    still holding the courier's work file gets a line with the command that sends its records."""
    import dataclasses

    from tracking.store import COURIER_FILE, DELIVER_COMMAND

    def at(root: Path):
        base = load_profile("local")
        return dataclasses.replace(base, storage=dataclasses.replace(base.storage, checkpoints=str(root)))

    for run in ("a-run", "b-run", "delivered"):
        (tmp_path / run).mkdir()
    for run in ("b-run", "a-run"):
        (tmp_path / run / COURIER_FILE).write_text("{}")  # the courier deletes it once everything is sent
    assert jobs.undelivered_runs(at(tmp_path)) == [
        f"run folder {tmp_path / run} holds MLflow records its courier had not sent; "
        f"`{DELIVER_COMMAND} {tmp_path / run}` sends them"
        for run in ("a-run", "b-run")
    ]
    assert jobs.undelivered_runs(at(tmp_path / "no-runs-yet")) == []


def test_stop_without_a_local_head_says_nothing_is_running(tmp_path, capsys):
    import dataclasses

    base = load_profile("local")
    profile = dataclasses.replace(base, ray=dataclasses.replace(base.ray, temp_dir=str(tmp_path)))  # no head.json
    assert jobs._stop(profile) == 0
    assert capsys.readouterr().out == "nothing to stop: no Ray head of this project is running for profile local\n"


def test_auth_headers_follow_rays_token_lookup(monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text("abc123\n")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert local_head.auth_headers() == {"Authorization": "Bearer abc123"}
    monkeypatch.setenv("HOME", str(tmp_path))  # "~" in the path is the home folder, as cluster.env reads it
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "~/token")
    assert local_head.auth_headers() == {"Authorization": "Bearer abc123"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "fromenv")
    assert local_head.auth_headers() == {"Authorization": "Bearer fromenv"}
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert local_head.auth_headers() == {}
    monkeypatch.setenv("RAY_AUTH_MODE", "sometimes")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE"):
        local_head.auth_mode_from_env()


def _ray_temp_dir() -> str:
    """A Ray temp dir of the test's own under /tmp, not under tmp_path: Ray's unix sockets live in
    <temp dir>/session_<date>_<pid>/sockets/, and an AF_UNIX path may not exceed 107 bytes (a pytest tmp_path under
    xdist is ~70 of them before Ray adds ~65). The test removes it."""
    return tempfile.mkdtemp(prefix="vsd", dir="/tmp")


def _local_profile_file(path: Path, temp_dir: str) -> Path:
    """The `local` profile at `path` with Ray's temp dir `temp_dir`, a dashboard port that is not 8265 (the head's port
    must be read, not assumed), one CPU and one worker."""
    text = (ROOT / "cluster/profiles/local.yaml").read_text()
    for pattern, value in [
        (r"temp_dir: .*", f'temp_dir: "{temp_dir}"'),
        (r"dashboard_port: \d+", f"dashboard_port: {free_port()}"),
        (r"head_num_cpus: \d+", "head_num_cpus: 1"),
        (r"num_workers: \d+", "num_workers: 1"),
    ]:
        text, n = re.subn(pattern, value, text, count=1)
        assert n == 1, pattern
    path.write_text(text)
    return path


def _parse_exports(text: str) -> dict[str, str]:
    """`export NAME=VALUE` lines (shell-quoted values) → {NAME: VALUE}; any other non-empty line is an error."""
    found = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        words = shlex.split(line)
        assert len(words) == 2 and words[0] == "export" and "=" in words[1], f"not an export line: {line!r}"
        name, value = words[1].split("=", 1)
        found[name] = value
    return found


def test_env_of_a_remote_profile_turns_on_the_token_its_head_requires(monkeypatch, tmp_path, capsys):
    """A rendered cluster's head runs with RAY_AUTH_MODE=token (cluster.render): `make env CLUSTER=a100x64` exports
    it, and the token's file as the local profile does; never the token itself."""
    from cluster import env

    _token_auth(monkeypatch, tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(local_head, "read_state", lambda profile: None)  # a local head on 8265 would be refused
    assert env.main(["--cluster", "a100x64"]) == 0
    assert _parse_exports(capsys.readouterr().out) == {
        "RAY_ADDRESS": "http://127.0.0.1:8265",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str((tmp_path / "token").resolve()),
    }
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")  # no token anywhere: said, as for a local head
    assert env.main(["--cluster", "a100x64"]) == 0
    captured = capsys.readouterr()
    assert _parse_exports(captured.out) == {"RAY_ADDRESS": "http://127.0.0.1:8265", "RAY_AUTH_MODE": "token"}
    assert "no Ray token was found" in captured.err


def _ray_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """The venv's own `ray` executable: the Ray CLI a user of this project runs."""
    ray = str(Path(sys.executable).with_name("ray"))
    return subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


FRESH = int(os.environ.get("VITSCALE_FRESH_HEADS", "0"))  # more fresh heads, each taking a job (a measurement)
RETRY_LINE = "Ray's job agent on the head is not registered yet; retrying for up to 60 s"


def _token_auth(monkeypatch, tmp_path: Path) -> None:
    """A token of this test's own, no Ray address inherited; the test itself sets RAY_AUTH_MODE=token (how: below)."""
    token = tmp_path / "token"
    token.write_text("vitscale-test-token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)


def _job(submission_id: str) -> dict:
    """A trivial job, as `jobs.submit` sends it to Ray."""
    entrypoint = "python -c \"print('job ran')\""
    return dict(entrypoint=entrypoint, runtime_env={}, submission_id=submission_id, metadata=dict(jobs.JOB_METADATA))


def _job_end(client, job_id: str, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (status := client.get_job_status(job_id)).is_terminal():
        assert time.monotonic() < deadline, f"job {job_id} still {status} after {timeout_s} s"
        time.sleep(0.5)
    return str(status.value)


def _stop_our_head(profile, temp_dir: str) -> list[int]:
    """Stop the head under `temp_dir` by PID (`local_head.stop_head`), remove the dir; the processes left over."""
    state = local_head.read_state(profile)
    local_head.stop_head(profile, grace_s=2.0)  # gcs_server, raylet and monitor outlive SIGTERM: KILLed 8 s sooner
    resolved = str(Path(temp_dir).resolve())
    leftover = [
        p
        for p in local_head._processes_of(resolved, state.gcs_address if state else None)
        if not local_head._is_zombie(p)
    ]
    shutil.rmtree(temp_dir, ignore_errors=True)
    return leftover


def _fresh_head_takes_a_job(profile_path: Path, submission_id: str) -> tuple[float, int, str, list[int]]:
    """Start a fresh head, submit the moment it is ready, run the job, stop the head: (seconds until `connect`
    returned, retries the submission needed, the job's final status, processes left over)."""
    temp_dir = _ray_temp_dir()
    profile = load_profile(_local_profile_file(profile_path, temp_dir))
    try:
        start = time.monotonic()
        client = jobs.connect(profile, start_local=True)
        ready_s = time.monotonic() - start
        job_id, retries = jobs._submit_counting_retries(client, _job(submission_id), jobs.AGENT_WAIT_S)
        status = _job_end(client, job_id)
    finally:
        leftover = _stop_our_head(profile, temp_dir)
    return ready_s, retries, status, leftover


def _gcs(info: local_head.HeadInfo, method: str, *args, **kwargs):
    """One call of Ray's GCS client on our head; inside `local_head.ray_auth_mode` as the head's."""
    from ray._raylet import GcsClient

    return getattr(GcsClient(address=info.gcs_address), method)(*args, **kwargs)


def _agent_key(info: local_head.HeadInfo) -> bytes:
    """Where the head's job agent registers, and Ray's Jobs API looks for it (`local_head._registered_job_agent`)."""
    from ray._private import ray_constants
    from ray.dashboard import consts

    node_id = _gcs(info, "internal_kv_get", ray_constants.KV_HEAD_NODE_ID_KEY, namespace=ray_constants.KV_NAMESPACE_JOB)
    return f"{consts.DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX}{node_id.decode()}".encode()


@pytest.mark.waits
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_submit_retries_only_while_no_job_agent_is_registered(monkeypatch, tmp_path, capsys):
    """The submission's safety net, against a real head whose job agent's registration is removed from GCS (as the
    dashboard does for a dead node) before any job was submitted (the Jobs API keeps an agent it once used):
    `ensure_head` then waits for it and names it; `jobs.submit` gives up after its wait with RayUnreachableError
    (the launcher's exit 2), retries while the agent is missing and is taken once it is back, saying so in one line;
    any other error is raised at once.

    This process talks to the GCS itself, so token auth is turned on with `ray_auth_mode` (the variable and Ray's
    process-wide state; conftest.no_ray_auth_leak), not with the variable alone."""
    _token_auth(monkeypatch, tmp_path)
    temp_dir = _ray_temp_dir()
    profile = load_profile(_local_profile_file(tmp_path / "local_test.yaml", temp_dir))
    try:
        with local_head.ray_auth_mode("token"):
            refused_s, retries = _refused_retried_raised(profile)
    finally:
        leftover = _stop_our_head(profile, temp_dir)
    assert leftover == []
    err = capsys.readouterr().err
    assert err.count(RETRY_LINE) == 1, err  # once, however many retries: the retried submission's line
    print(f"refused after {refused_s:.1f} s; taken after {retries} retries")


def _refused_retried_raised(profile) -> tuple[float, int]:
    """The body of the test above: (seconds until the refusal without retry, retries until the job was taken)."""
    from ray._private.ray_constants import KV_NAMESPACE_DASHBOARD as NS

    client = jobs.connect(profile, start_local=True)
    info = local_head.read_state(profile)
    key = _agent_key(info)
    registration = _gcs(info, "internal_kv_get", key, namespace=NS)
    assert registration
    _gcs(info, "internal_kv_del", key, False, namespace=NS)

    with pytest.raises(RuntimeError, match="its job agent did not register in GCS") as err:
        local_head.ensure_head(profile, timeout_s=3)  # reused: waits for the agent, leaves the head running
    assert local_head.AGENT_LOG in str(err.value) and local_head._dashboard_alive(info.dashboard_url)

    start = time.monotonic()
    with pytest.raises(jobs.RayUnreachableError, match="job agent on the head did not register within 1 s"):
        jobs.submit(client, "python -c pass", {}, "vitscale-never", agent_wait_s=1)
    refused_s = time.monotonic() - start  # one refusal: Ray's own 10 s wait for the agent

    # The agent registers again 15 s in: the first attempt is refused after 10 s, a retry is taken.
    back = threading.Timer(15.0, _gcs, (info, "internal_kv_put", key, registration, True), {"namespace": NS})
    back.start()
    try:
        job_id, retries = jobs._submit_counting_retries(client, _job("vitscale-retried"), jobs.AGENT_WAIT_S)
    finally:
        back.join()
    assert retries >= 1
    assert _job_end(client, job_id) == "SUCCEEDED"

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="already exists") as err:
        jobs.submit(client, "python -c pass", {}, "vitscale-retried")  # a 4xx from the agent: no retry
    assert not isinstance(err.value, jobs.RayUnreachableError) and time.monotonic() - start < 10
    return refused_s, retries


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_head_with_token_auth_submit_status_logs_ray_cli_stop(monkeypatch, tmp_path, capsys, caplog):
    """One head for the whole life cycle: start our own (private temp dir, free ports, 127.0.0.1 dashboard on a port
    that is not 8265, token auth ON with a test token) on a busy machine and submit the moment `connect` returns
    (issue #51: `ensure_head` used to return before the head's job agent had registered, and 1 launch in 9 was
    refused), follow the job with `cluster.jobs status|logs`, then with Ray's own CLI (`ray job list|logs`) in exactly
    the environment `python -m cluster.env` prints (`make env`), then `stop` kills exactly our processes.

    ``VITSCALE_FRESH_HEADS=10`` first starts that many more fresh heads, each taking a job the moment it is ready,
    and prints their seconds (the measurement behind "10 of 10"); the suite starts this one."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    _token_auth(monkeypatch, tmp_path)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_ADDRESS", "http://10.255.255.1:8265")  # must be ignored by the local profile
    token = tmp_path / "token"
    with caplog.at_level(logging.INFO, logger="cluster.local_head"):
        extra = [_fresh_head_takes_a_job(tmp_path / f"fresh_{i}.yaml", f"vitscale-fresh-{i}") for i in range(FRESH)]
    waits = [r.args for r in caplog.records if r.name == "cluster.local_head" and "job agent" in r.msg]
    for i, ((ready_s, retries, status, leftover), (_, dashboard_s, agent_s)) in enumerate(zip(extra, waits)):
        waited = f"dashboard {dashboard_s:.1f} s, then the job agent {agent_s:.1f} s"
        with capsys.disabled():  # the measurement's lines, not for the checks of this test's own output below
            print(f"fresh head {i}: ready {ready_s:.1f} s after the start ({waited}); retries {retries}; job {status}")
        assert (retries, status, leftover) == (0, "SUCCEEDED", [])
    temp_dir = _ray_temp_dir()
    # A profile file (not only a dataclass) so that `python -m cluster.env --cluster <file>` finds the same head.
    profile_path = _local_profile_file(tmp_path / "local_test.yaml", temp_dir)
    profile = load_profile(profile_path)
    info = None
    # The profile's dashboard port is taken between the check and Ray's bind (any process's connection can take a
    # port): the failed start is cleared and the head started again on other ports.
    taken = socket.socket()
    taken.bind(("127.0.0.1", profile.ray.dashboard_port))
    taken.listen()
    port_free, fooled = local_head._port_free, []

    def seen_free_once(port: int) -> bool:  # the check passes once: the port is taken just after it
        if port == profile.ray.dashboard_port and not fooled:
            fooled.append(port)
            return True
        return port_free(port)

    monkeypatch.setattr(local_head, "_port_free", seen_free_once)
    try:
        with cpu_burners(2, measuring=bool(FRESH)):
            client = jobs.connect(profile, start_local=True)
            request = _job("vitscale-test-job")
            request["entrypoint"] = "python -c \"import sys; print('hello from', sys.executable)\""
            job_id, retries = jobs._submit_counting_retries(client, request, jobs.AGENT_WAIT_S)
        taken.close()
        assert fooled, "the first `ray start` was not given the taken port"
        assert retries == 0, "the readiness wait, not the submission's retry, must let the job in"
        info = local_head.read_state(profile)
        assert info.dashboard_url.startswith("http://127.0.0.1:") and info.auth_mode == "token"
        assert not info.dashboard_url.endswith(f":{profile.ray.dashboard_port}")  # started again, elsewhere
        assert info.temp_dir == temp_dir
        assert local_head.ensure_head(profile) == info  # reused, not started twice
        with pytest.raises(AuthenticationError):
            JobSubmissionClient(info.dashboard_url).list_jobs()  # no token, no access
        assert jobs.follow(client, job_id) == "SUCCEEDED"
        # KubeRay's operator polls a job's state with the token in this header (render names it in authOptions)
        job_url = f"{info.dashboard_url}/api/jobs/{job_id}"
        bearer = {"x-ray-authorization": "Bearer vitscale-test-token"}
        with urllib.request.urlopen(urllib.request.Request(job_url, headers=bearer), timeout=30) as polled:
            assert json.loads(polled.read())["status"] == "SUCCEEDED"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(job_url, timeout=30)  # without it (KubeRay without authOptions): refused
        out = capsys.readouterr().out
        assert f"hello from {Path(sys.executable).parent}" in out  # the job's python is this venv's
        assert jobs._status(profile) == 0
        assert "vitscale-test-job" in capsys.readouterr().out
        assert jobs._logs(profile, follow_logs=False) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"job {job_id}: SUCCEEDED, started ") and "hello from" in out  # named: which job
        # `make stop CLUSTER=a100x64` (this head standing in for the cluster) with two jobs running: which is the
        # user's? Neither is stopped (it stopped all of them), both are named.
        remote = load_profile("a100x64")
        monkeypatch.setenv("RAY_ADDRESS", info.dashboard_url)
        for name in ("vitscale-test-older", "vitscale-test-newest"):
            client.submit_job(**{**_job(name), "entrypoint": "python -c 'import time; time.sleep(600)'"})
        assert jobs._stop(remote) == 2
        err = capsys.readouterr().err
        assert "2 vitscale jobs run on profile a100x64's cluster (vitscale-test-" in err and "ray job stop ID" in err
        assert all(not client.get_job_status(n).is_terminal() for n in ("vitscale-test-older", "vitscale-test-newest"))
        # A GPU profile's address that is this head (its `ray dashboard` port, taken by it): refused, never its jobs
        monkeypatch.setattr(profiles, "PROFILES_DIR", profile_path.parent)  # where `local_test` lives
        with pytest.raises(jobs.RayUnreachableError, match="is this project's local Ray head .profile local_test."):
            jobs.connect(remote)
        with pytest.raises(jobs.RayUnreachableError, match="is this project's local Ray head"):
            cluster_env.exports(remote)  # `make env CLUSTER=a100x64`: Ray's CLI would list and stop this head's jobs

        # Ray's own CLI, in the shell of a user who ran `eval "$(make -s env)"`: no other Ray variable.
        env_cmd = [sys.executable, "-m", "cluster.env", "--cluster", str(profile_path)]
        printed = subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert printed.returncode == 0, printed.stderr
        exports = _parse_exports(printed.stdout)
        assert exports == {
            "RAY_ADDRESS": info.dashboard_url,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token.resolve()),
        }
        cli_env = {**{k: v for k, v in os.environ.items() if k not in RAY_VARS}, **exports}
        listed = _ray_cli(["job", "list"], cli_env)
        assert listed.returncode == 0 and job_id in listed.stdout, listed.stdout + listed.stderr
        logs = _ray_cli(["job", "logs", job_id], cli_env)
        assert logs.returncode == 0 and "hello from" in logs.stdout, logs.stdout + logs.stderr
        # A lab's own submission (README, "Quick start"): the code shipped as the working dir, the plan made inside
        # the job by the same planner as `make launch`.
        driver = ["python", "-m", "cluster.driver", "--cluster", "local", "--recipe", "local_demo", "--dry-run"]
        submitted = _ray_cli(["job", "submit", "--working-dir", ".", "--", *driver], cli_env)
        out = submitted.stdout + submitted.stderr
        assert submitted.returncode == 0 and "succeeded" in out.lower(), out
        assert "plan: recipe local_demo" in out and "dry run: nothing trained" in out, out
        # Why RAY_AUTH_MODE is exported: without it Ray's CLI sends no token and the head refuses it.
        refused = _ray_cli(["job", "list"], {k: v for k, v in cli_env.items() if k != "RAY_AUTH_MODE"})
        assert refused.returncode != 0 and job_id not in refused.stdout
        assert re.search(r"authentication", refused.stdout + refused.stderr, re.IGNORECASE)

        ours = local_head._processes_of(str(Path(temp_dir).resolve()), info.gcs_address)
        assert ours
        proxies = local_head._processes_of("no-such-dir", info.gcs_address)  # the Ray Client proxy, by address
        assert proxies and set(proxies) <= set(ours)
    finally:
        taken.close()
        assert jobs._stop(profile) == 0
        leftover = []
        if info is not None:
            leftover = [
                p
                for p in local_head._processes_of(str(Path(temp_dir).resolve()), info.gcs_address)
                if not local_head._is_zombie(p)
            ]
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert "stopped the local Ray head" in capsys.readouterr().out
    assert leftover == []
    # A head stopped while `make launch` follows its job (`make stop` in another shell): one error, not a traceback.
    started = time.monotonic()
    with pytest.raises(jobs.RayUnreachableError, match=rf"lost the Ray Jobs API at .* while following job {job_id}"):
        jobs.follow(client, job_id, lost_s=1.0)
    assert time.monotonic() - started < 30


def test_connect_turns_rays_rpc_error_into_the_unreachable_line(monkeypatch):
    """An address without http:// (RAY_ADDRESS=127.0.0.1:8265) is taken by Ray for a GCS one: after its wait, an
    RpcError, not one of the errors of an HTTP client; `make status` says so in one line, not a traceback."""
    import ray.job_submission
    from ray.exceptions import RpcError

    def refuse(address, headers=None):
        raise RpcError("Timed out while waiting for GCS to become available.\nGCS address: " + address)

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", refuse)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:8265")
    with pytest.raises(jobs.RayUnreachableError) as info:
        jobs.connect(load_profile("a100x64"))
    message = str(info.value)
    assert message.startswith("cannot reach the Ray Jobs API of profile a100x64 at 127.0.0.1:8265: Timed out")
    assert "\n" not in message and "RAY_ADDRESS=http://127.0.0.1:8265" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "main, argv, kept",
    [
        (launch.main, ["--cluster", "a100x64"], "python -m cluster.launch: interrupted; no job submitted"),
        (preflight.main, ["--cluster", "a100x8"], "python -m cluster.preflight: interrupted; no verdict"),
        (jobs.main, ["status", "--cluster", "a100x64"], "python -m cluster.jobs: interrupted;"),
        (render.main, ["--cluster", "h100x8"], "python -m cluster.render: interrupted; each file it wrote is whole"),
    ],
)
def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, tmp_path, capsys, main, argv, kept):
    """Ctrl-C while the entry point connects (or starts the local head), or plans the render: one line, status 130."""

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(jobs, "connect", interrupt)
    monkeypatch.setattr(render, "build_plan", interrupt)
    monkeypatch.chdir(tmp_path)  # render's ./rendered
    try:
        assert main(argv) == 130
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended in a traceback")
    assert capsys.readouterr().err.startswith(kept)


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_local_head_starts_leaves_no_ray_process(monkeypatch, tmp_path):
    """`ray start --head` leaves its daemons running when interrupted, before head.json names them: they are stopped
    (before, they ran on unseen, and `make stop` found nothing to stop)."""
    import dataclasses
    import signal

    base = load_profile("local")
    profile = dataclasses.replace(base, ray=dataclasses.replace(base.ray, temp_dir=str(tmp_path)))
    # `ray start`: a daemon in a session of its own, output to its logs, as Ray's; then it waits
    started = tmp_path / "daemon-started"
    wait = f"open({str(started)!r}, 'w'); import time; time.sleep(120)"
    daemon = [sys.executable, "-c", wait, f"--temp-dir={tmp_path}"]
    start = f"import subprocess, time; subprocess.Popen({daemon!r}, start_new_session=True, stdout=-3, stderr=-3)"
    monkeypatch.setattr(
        local_head, "_ray_start_command", lambda *args: [sys.executable, "-c", f"{start}; time.sleep(120)"]
    )
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    done = threading.Event()

    def ctrl_c_once_the_daemon_runs() -> None:
        while not started.exists() and not done.wait(0.1):
            pass
        if not done.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Python's own handler: a suite started in the background (`make test &`) inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=ctrl_c_once_the_daemon_runs, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            local_head.ensure_head(profile)
    finally:
        done.set()
        signal.signal(signal.SIGINT, previous)
    assert started.exists() and local_head.stop_head(profile) == []  # it signals what it finds


def test_a_stale_head_json_never_takes_a_tunnel_for_the_local_head(monkeypatch, tmp_path, capsys):
    """head.json outlives a reboot or a killed head, and a `ray dashboard` tunnel to a GPU cluster may hold its port
    since: that cluster is not refused as the local head (it was, by its port), and `make status/stop` on `local` no
    longer reach it (`make stop` would have stopped every job there)."""
    import dataclasses
    import http.server

    class Cluster(http.server.BaseHTTPRequestHandler):  # the tunnel's far end: a Ray head of another session
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"session_name": "session_of_the_cluster"}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Cluster)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        profile_path = _local_profile_file(tmp_path / "local_test.yaml", str(tmp_path))
        (tmp_path / "session_before_the_reboot").mkdir()
        (tmp_path / "session_latest").symlink_to(tmp_path / "session_before_the_reboot")
        stale = local_head.HeadInfo("127.0.0.1:1", url, str(tmp_path), "disabled", started_by_us=True)
        (tmp_path / local_head.STATE_FILE).write_text(json.dumps(dataclasses.asdict(stale)))
        remote = load_profile("a100x64")
        monkeypatch.setattr(profiles, "PROFILES_DIR", tmp_path)  # where `local_test` lives
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        jobs.refuse_local_head(remote, url)  # the cluster, reached through its tunnel: no refusal
        with pytest.raises(jobs.RayUnreachableError, match="no Ray head of this project is running"):
            jobs.connect(load_profile(profile_path))
        assert local_head.serves(stale, url) is False
        (tmp_path / "session_latest").unlink()
        (tmp_path / "session_latest").symlink_to(tmp_path / "session_of_the_cluster")  # were it ours: refused
        with pytest.raises(jobs.RayUnreachableError, match="is this project's local Ray head"):
            jobs.refuse_local_head(remote, url)
    finally:
        server.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_refuses_a_run_name_whose_job_still_runs(monkeypatch, tmp_path, capsys, local_demo_data):
    """`make launch RUN_NAME=r` while a job of run r still runs (its launch Ctrl-C'd: "the job keeps running") started
    a second job on the same run folder: two trainings saving the same checkpoint steps, one MLflow run. Refused in
    one line now; a run whose name merely begins the same is no conflict, and an ended job none either."""
    _token_auth(monkeypatch, tmp_path)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    temp_dir = _ray_temp_dir()
    path = _local_profile_file(tmp_path / "local_test.yaml", temp_dir)
    text = path.read_text()
    for key, value in (("shards", local_demo_data), ("checkpoints", tmp_path / "runs")):
        text, n = re.subn(rf"{key}: .*", f'{key}: "{value}"', text, count=1)
        assert n == 1, key
    path.write_text(text)
    profile = load_profile(path)
    sleeper = "python -c 'import time; time.sleep(600)'"
    try:
        client = jobs.connect(profile, start_local=True)
        for job_id in ("vitscale-busy-1700000000", "vitscale-busy-2-1700000001"):
            client.submit_job(**{**_job(job_id), "entrypoint": sleeper})
        argv = ["--cluster", str(path), "--run-name", "busy", "--no-follow", "--set", "evals.suite=null"]
        assert launch.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            "python -m cluster.launch: error: run busy is still being trained by Ray job vitscale-busy-1700000000: "
        ), err
        assert err.count("\n") == 1 and "make stop" in err
        assert not (tmp_path / "runs" / "busy").exists()
        assert jobs.unfinished_jobs_of(client, "busy-2") == ["vitscale-busy-2-1700000001"]
        client.stop_job("vitscale-busy-1700000000")
        _job_end(client, "vitscale-busy-1700000000")
        assert jobs.unfinished_jobs_of(client, "busy") == []
    finally:
        leftover = _stop_our_head(profile, temp_dir)
    assert leftover == []


def test_logs_names_the_job_it_shows_and_another_can_be_picked(tmp_path):
    """`make logs` shows the newest vitscale job: with a colleague's or a finished one beside it, its first line
    names the job (id, status, run folder) and how to show another; `--job ID` picks one, an unknown id is one line."""
    from ray.job_submission import JobDetails, JobStatus, JobType

    from cluster.driver.job import PLAN_ENV

    assert jobs.PLAN_ENV == PLAN_ENV

    def job(name: str, status: JobStatus, started_ms: int) -> JobDetails:
        spec = {"config": {"checkpoint": {"dir": f"/fsx/checkpoints/{name}"}}}
        env = {"env_vars": {PLAN_ENV: json.dumps(spec)}}
        return JobDetails(
            type=JobType.SUBMISSION, submission_id=f"vitscale-{name}-{started_ms}", status=status,
            entrypoint="python -m cluster.driver", start_time=started_ms, metadata=dict(jobs.JOB_METADATA),
            runtime_env=env,
        )  # fmt: skip

    listed = [job("mine", JobStatus.RUNNING, 1_000), job("colleague", JobStatus.SUCCEEDED, 2_000)]
    remote = load_profile("a100x64")
    job_id, line = jobs.pick_job(listed, remote, None)
    assert job_id == "vitscale-colleague-2000"
    assert line.startswith("job vitscale-colleague-2000: SUCCEEDED, started ")
    assert "run folder /fsx/checkpoints/colleague (the newest of 2 vitscale jobs" in line
    assert "python -m cluster.jobs logs --cluster a100x64 --job ID` shows another" in line
    job_id, line = jobs.pick_job(listed, remote, "vitscale-mine-1000")
    assert job_id == "vitscale-mine-1000" and line.startswith("job vitscale-mine-1000: RUNNING")
    assert line.endswith("run folder /fsx/checkpoints/mine")  # asked for: no note of the others
    with pytest.raises(ValueError, match="no vitscale job vitscale-nope on profile a100x64's cluster; `make status"):
        jobs.pick_job(listed, remote, "vitscale-nope")
    lab = JobDetails(type=JobType.SUBMISSION, submission_id="raysubmit_1", status=JobStatus.PENDING, entrypoint="x")
    assert jobs.pick_job([lab], remote, None)[1].startswith("job raysubmit_1: PENDING, started ")  # no spec: no folder


def test_a_job_failed_before_its_entrypoint_ran_is_said_in_one_line():
    """Ray's messages for a FAILED job: the entrypoint's own failure (its log says why) gives no line; a runtime env
    that failed gives its first and last lines."""
    assert jobs.why_failed(None) == jobs.why_failed("") == ""
    ran = "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\nboom\n"
    assert jobs.why_failed(ran) == ""
    setup = (
        "runtime_env setup failed: Failed to set up runtime environment.\nCould not create the actor because its "
        "associated runtime env failed to be created.\n[Node 10.0.0.1] Traceback (most recent call last):\n  File "
        '"x.py", line 1, in f\n    raise\nERROR: No matching distribution found for s3fs==99\n'
    )
    assert jobs.why_failed(setup) == (
        "runtime_env setup failed: Failed to set up runtime environment. ... ERROR: No matching distribution found for "
        "s3fs==99"
    )
    assert jobs.why_failed("Unexpected error occurred: the actor died") == "Unexpected error occurred: the actor died"


def test_a_jobs_code_is_packed_once_with_the_files_ray_would_pack(tmp_path):
    """`jobs.submit` hands Ray a zip of the working dir, made once: Ray's default excludes (.git), .gitignore, the
    runtime env's excludes left out, the files at the zip's top level as Ray unpacks them; a URI or no working dir
    passes through unchanged."""
    import zipfile

    for name, text in [
        (".gitignore", "/data/\n*.log\n"),
        ("a.py", "a"),
        ("sub/b.py", "b"),
        ("sub/c.log", "c"),
        ("data/x", "x"),
        (".git/HEAD", "ref"),
        ("runs/r", "r"),
    ]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {"working_dir": str(tmp_path), "excludes": ["runs/"], "env_vars": {"K": "v"}}
    with jobs.code_snapshot(env) as packed:
        assert packed["working_dir"].endswith(".zip") and "excludes" not in packed
        assert packed["env_vars"] == {"K": "v"}
        with zipfile.ZipFile(packed["working_dir"]) as package:
            files = {name for name in package.namelist() if not name.endswith("/")}
    assert files == {".gitignore", "a.py", "sub/b.py"}
    assert not Path(packed["working_dir"]).exists()  # removed once submitted
    for unchanged in ({"working_dir": "gcs://_ray_pkg_0123.zip"}, {"env_vars": {}}):
        with jobs.code_snapshot(unchanged) as packed:
            assert packed is unchanged


@contextlib.contextmanager
def _port_held(port: int) -> Iterator[None]:
    """``port`` on 127.0.0.1 held for the block (by another process already, or here)."""
    with socket.socket() as sock:
        with contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            sock.listen()
        yield


@contextlib.contextmanager
def _ray_log() -> Iterator[list[str]]:
    """The messages Ray's loggers write in the block."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ray").addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger("ray").removeHandler(handler)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_launched_jobs_processes_ask_their_own_head_when_a_newer_ray_runs(monkeypatch, tmp_path, capsys):
    """Ray Train's placement-group cleaner, in the job's processes, asks Ray's state API whether the controller lives:
    without RAY_ADDRESS that is the newest Ray on the machine (an in-process `ray.init()`, another project's head),
    and a Ray that says no had the workers' placement group removed mid-training. `launch.runtime_env` names the
    head; a job's task resolves the Ray that lookup finds, with another Ray started after the head.

    On the same head, a job submitted by a process whose output goes to a file in the working dir (`make launch >
    launch.log` in the checkout) runs: given the folder, Ray named the package by one hash of it, logged, and uploaded
    it under another, and the job failed setting up its runtime env ("Failed to download runtime_env file package"),
    which `make launch` and `make logs` did not say: the job had no log; they print Ray's reason now."""
    from cluster.driver.job import JobSpec
    from cluster.plan.planner import build_plan, resolve_config

    for var in RAY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp_dir = _ray_temp_dir()
    profile = load_profile(_local_profile_file(tmp_path / "local_test.yaml", temp_dir))
    script = tmp_path / "where.py"
    script.write_text(
        "import ray\nfrom ray._private.services import canonicalize_bootstrap_address_or_die as found\n"
        "@ray.remote(num_cpus=0)\ndef where():\n    try:\n        return found(None)\n"
        "    except Exception as error:  # none found: the cleaner's thread dies of it\n"
        "        return type(error).__name__\n"
        "print('resolved', ray.get(where.remote()))\n"
    )
    try:
        client = jobs.connect(profile, start_local=True)
        head = local_head.read_state(profile)
        with local_head.ray_auth_mode("disabled"):
            with _port_held(8265), _ray_log() as said:  # Ray's default dashboard port, as a head there holds it
                cluster = local_head.in_process_cluster(num_cpus=1, include_dashboard=False)  # the newest Ray now
            newer = cluster.address
            try:
                assert not [m for m in said if "already occupied" in m], said  # an ERROR line in the elastic demo
                config = resolve_config(profile, "local_demo", [], "where")
                env = launch.runtime_env(profile, JobSpec.create(profile, config, build_plan(profile, config)))
                job_id = jobs.submit(client, f"python {script}", env, "vitscale-where")
                assert jobs.follow(client, job_id, out=io.StringIO()) == "SUCCEEDED"
                logs = client.get_job_logs(job_id)
            finally:
                cluster.shutdown()
        code = tmp_path / "checkout"
        (code / "pkg").mkdir(parents=True)
        (code / "pkg" / "__init__.py").write_text("WHAT = 'the code as submitted'\n")
        (code / ".gitignore").write_text("/runs/\n")  # Ray logs a line on reading it, into the log below
        output = logging.FileHandler(code / "launch.log")  # this process's output lands in the working dir
        logging.getLogger("ray").addHandler(output)
        try:
            job_id = jobs.submit(
                client, "python -c 'import pkg; print(pkg.WHAT)'", {"working_dir": str(code)}, "vitscale-logging"
            )
        finally:
            logging.getLogger("ray").removeHandler(output)
            output.close()
        assert jobs.follow(client, job_id, out=io.StringIO()) == "SUCCEEDED", client.get_job_logs(job_id)
        assert "the code as submitted" in client.get_job_logs(job_id)

        # A job Ray fails before its entrypoint runs (here its code's package is missing) has no log to say why:
        # following it, and `make logs` after it, end with Ray's reason in one line.
        missing = "gcs://_ray_pkg_0123456789abcdef.zip"
        job_id = jobs.submit(client, "python -c pass", {"working_dir": missing}, "vitscale-no-code")
        followed = io.StringIO()
        assert jobs.follow(client, job_id, out=followed) == "FAILED"
        reason = followed.getvalue().splitlines()[-1]
        assert reason.startswith(f"job {job_id}: runtime_env setup failed") and missing in reason, followed.getvalue()
        jobs._logs(profile, False, job_id)
        assert capsys.readouterr().out.splitlines()[-1] == reason
    finally:
        local_head.stop_head(profile)
        shutil.rmtree(temp_dir, ignore_errors=True)
    resolved = re.search(r"resolved (\S+)", logs).group(1)
    assert resolved.endswith(":" + head.gcs_address.rsplit(":", 1)[1]), (resolved, newer, logs)
