"""cluster.jobs + cluster.local_head: unreachable clusters, the embedded head (token auth), submit/status/logs/stop."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from cluster import jobs, launch, local_head
from cluster.profiles import load_profile


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_head_with_token_auth_submit_status_logs_stop(monkeypatch, tmp_path, capsys):
    """Start our own head (private temp dir, free ports, 127.0.0.1 dashboard, token auth ON with a test token),
    run a job through the Jobs API, then `stop` kills exactly our processes."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    token = tmp_path / "token"
    token.write_text("vitscale-test-token")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "http://10.255.255.1:8265")  # must be ignored by the local profile
    temp_dir = tempfile.mkdtemp(prefix="vsd", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    base = load_profile("local")
    profile = dataclasses.replace(
        base, ray=dataclasses.replace(base.ray, temp_dir=temp_dir, dashboard_port=_closed_port(), head_num_cpus=1)
    )
    try:
        client = jobs.connect(profile, start_local=True)
        info = local_head.read_state(profile)
        assert info.dashboard_url.startswith("http://127.0.0.1:") and info.auth_mode == "token"
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
        ours = local_head._processes_of(str(Path(temp_dir).resolve()), info.gcs_address)
        assert ours
        proxies = local_head._processes_of("no-such-dir", info.gcs_address)  # the Ray Client proxy, by address
        assert proxies and set(proxies) <= set(ours)
    finally:
        assert jobs._stop(profile) == 0
        leftover = [p for p in local_head._processes_of(str(Path(temp_dir).resolve()), info.gcs_address)
                    if not local_head._is_zombie(p)]  # fmt: skip
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert "stopped the local Ray head" in capsys.readouterr().out
    assert leftover == []
