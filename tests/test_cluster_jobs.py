"""cluster.jobs + cluster.local_head + cluster.env: unreachable clusters, and the embedded head (token auth) through
its life: submit, status, logs, Ray's own CLI (`ray job list|logs` with the exports `make env` prints), stop."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster import jobs, launch, local_head
from cluster.profiles import load_profile

ROOT = Path(__file__).resolve().parent.parent
RAY_VARS = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.timeout(120)
def test_unreachable_ray_address_says_how_to_start_the_cluster(monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(jobs.RayUnreachableError) as info:
        jobs.connect(load_profile("a100x64"))
    msg = str(info.value)
    assert "cannot reach the Ray Jobs API of profile a100x64" in msg and "ray up" in msg and "RAY_ADDRESS" in msg
    # The launcher prints the plan, then fails before submitting anything.
    assert launch.main(["--cluster", "a100x64", "--recipe", "vit_b16_i21k"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("plan: recipe vit_b16_i21k") and "submitted" not in captured.out
    assert "cannot reach" in captured.err


@pytest.mark.timeout(60)
def test_auth_headers_follow_rays_token_lookup(monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text("abc123\n")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert local_head.auth_headers() == {"Authorization": "Bearer abc123"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "fromenv")
    assert local_head.auth_headers() == {"Authorization": "Bearer fromenv"}
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert local_head.auth_headers() == {}
    monkeypatch.setenv("RAY_AUTH_MODE", "sometimes")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE"):
        local_head.auth_mode_from_env()


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


def _ray_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """The venv's own `ray` executable: the Ray CLI a user of this project runs."""
    ray = str(Path(sys.executable).with_name("ray"))
    return subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_head_with_token_auth_submit_status_logs_ray_cli_stop(monkeypatch, tmp_path, capsys):
    """One head for the whole life cycle: start our own (private temp dir, free ports, 127.0.0.1 dashboard on a port
    that is not 8265, token auth ON with a test token), run a job through the Jobs API, follow it with
    `cluster.jobs status|logs`, then with Ray's own CLI (`ray job list|logs`) in exactly the environment
    `python -m cluster.env` prints (`make env`), then `stop` kills exactly our processes."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    token = tmp_path / "token"
    token.write_text("vitscale-test-token")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))  # a non-default path: cluster.env must export it
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "http://10.255.255.1:8265")  # must be ignored by the local profile
    temp_dir = tempfile.mkdtemp(prefix="vsd", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    # A profile file (not only a dataclass) so that `python -m cluster.env --cluster <file>` finds the same head.
    text = (ROOT / "cluster/profiles/local.yaml").read_text()
    for pattern, value in [
        (r"temp_dir: .*", f'temp_dir: "{temp_dir}"'),
        (r"dashboard_port: \d+", f"dashboard_port: {_closed_port()}"),  # not 8265: the head's port must be read
        (r"head_num_cpus: \d+", "head_num_cpus: 1"),
        (r"num_workers: \d+", "num_workers: 1"),
    ]:
        text, n = re.subn(pattern, value, text, count=1)
        assert n == 1, pattern
    profile_path = tmp_path / "local_test.yaml"
    profile_path.write_text(text)
    profile = load_profile(profile_path)
    info = None
    try:
        client = jobs.connect(profile, start_local=True)
        info = local_head.read_state(profile)
        assert info.dashboard_url.startswith("http://127.0.0.1:") and info.auth_mode == "token"
        assert info.temp_dir == temp_dir
        assert local_head.ensure_head(profile) == info  # reused, not started twice
        with pytest.raises(AuthenticationError):
            JobSubmissionClient(info.dashboard_url).list_jobs()  # no token, no access
        job_id = jobs.submit(
            client, "python -c \"import sys; print('hello from', sys.executable)\"", {}, "vitscale-test-job"
        )
        assert jobs.follow(client, job_id) == "SUCCEEDED"
        out = capsys.readouterr().out
        assert f"hello from {Path(sys.executable).parent}" in out  # the job's python is this venv's
        assert jobs._status(profile) == 0
        assert "vitscale-test-job" in capsys.readouterr().out
        assert jobs._logs(profile, follow_logs=False) == 0
        assert "hello from" in capsys.readouterr().out

        # Ray's own CLI, in the shell of a user who ran `eval "$(make -s env)"`: no other Ray variable.
        env_cmd = [sys.executable, "-m", "cluster.env", "--cluster", str(profile_path)]
        printed = subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert printed.returncode == 0, printed.stderr
        exports = _parse_exports(printed.stdout)
        assert exports == {"RAY_ADDRESS": info.dashboard_url, "RAY_AUTH_MODE": "token",
                           "RAY_AUTH_TOKEN_PATH": str(token.resolve())}  # fmt: skip
        cli_env = {**{k: v for k, v in os.environ.items() if k not in RAY_VARS}, **exports}
        listed = _ray_cli(["job", "list"], cli_env)
        assert listed.returncode == 0 and job_id in listed.stdout, listed.stdout + listed.stderr
        logs = _ray_cli(["job", "logs", job_id], cli_env)
        assert logs.returncode == 0 and "hello from" in logs.stdout, logs.stdout + logs.stderr
        # Why RAY_AUTH_MODE is exported: without it Ray's CLI sends no token and the head refuses it.
        refused = _ray_cli(["job", "list"], {k: v for k, v in cli_env.items() if k != "RAY_AUTH_MODE"})
        assert refused.returncode != 0 and job_id not in refused.stdout
        assert re.search(r"authentication", refused.stdout + refused.stderr, re.IGNORECASE)

        ours = local_head._processes_of(str(Path(temp_dir).resolve()), info.gcs_address)
        assert ours
        proxies = local_head._processes_of("no-such-dir", info.gcs_address)  # the Ray Client proxy, by address
        assert proxies and set(proxies) <= set(ours)
    finally:
        assert jobs._stop(profile) == 0
        leftover = []
        if info is not None:
            leftover = [p for p in local_head._processes_of(str(Path(temp_dir).resolve()), info.gcs_address)
                        if not local_head._is_zombie(p)]  # fmt: skip
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert "stopped the local Ray head" in capsys.readouterr().out
    assert leftover == []
