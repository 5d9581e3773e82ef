"""Ray's own CLI (`ray job list`, `ray job logs`) against the embedded local head, set up by `python -m cluster.env`.

The head runs with token authentication, and Ray's CLI sends its token only when RAY_AUTH_MODE=token is in its
environment: `make env` prints that export beside RAY_ADDRESS (the head's real dashboard port). This test starts a
private head (its own temp dir, a free dashboard port, a test token), submits a trivial job, and runs the real `ray`
executable of this venv with exactly the environment `cluster.env` printed.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from cluster import jobs, local_head
from cluster.profiles import load_profile

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))  # the venv's Ray CLI, the one a user of this project runs
RAY_VARS = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


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
    return subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_job_cli_works_with_the_exports_of_cluster_env(monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text("vitscale-test-token")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))  # a non-default path: cluster.env must export it
    for var in ("RAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    temp_dir = tempfile.mkdtemp(prefix="vsc", dir="/tmp")  # short: Ray's unix socket paths are length-limited
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
    profile_path = tmp_path / "local_cli.yaml"
    profile_path.write_text(text)
    profile = load_profile(profile_path)
    info = None
    try:
        client = jobs.connect(profile, start_local=True)
        info = local_head.read_state(profile)
        assert info.auth_mode == "token" and info.temp_dir == temp_dir
        job_id = jobs.submit(client, "python -c \"print('vitscale-demo')\"", {}, f"vitscale-cli-{uuid.uuid4().hex[:8]}")
        assert jobs.follow(client, job_id, out=io.StringIO()) == "SUCCEEDED"

        env_cmd = [sys.executable, "-m", "cluster.env", "--cluster", str(profile_path)]
        printed = subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert printed.returncode == 0, printed.stderr
        exports = _parse_exports(printed.stdout)
        assert exports == {
            "RAY_ADDRESS": info.dashboard_url,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token.resolve()),
        }

        # The shell of a user who ran `eval "$(make -s env)"`: no other Ray variable than what was printed.
        base = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
        cli_env = {**base, **exports}
        listed = _ray_cli(["job", "list"], cli_env)
        print(f"$ ray job list\n{listed.stdout}{listed.stderr}")  # shown with `pytest -rP`
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert job_id in listed.stdout
        logs = _ray_cli(["job", "logs", job_id], cli_env)
        print(f"$ ray job logs {job_id}\n{logs.stdout}{logs.stderr}")
        assert logs.returncode == 0, logs.stdout + logs.stderr
        assert "vitscale-demo" in logs.stdout

        # Why RAY_AUTH_MODE is exported: without it Ray's CLI sends no token and the head refuses it.
        no_mode = {k: v for k, v in cli_env.items() if k != "RAY_AUTH_MODE"}
        refused = _ray_cli(["job", "list"], no_mode)
        print(f"$ ray job list  # without RAY_AUTH_MODE\n{refused.stdout}{refused.stderr}")
        assert refused.returncode != 0
        assert re.search(r"authentication", refused.stdout + refused.stderr, re.IGNORECASE)
        assert job_id not in refused.stdout
    finally:
        jobs._stop(profile)  # stops the job if still running and the head this test started (by PID, nothing else)
        leftover = []
        if info is not None:
            leftover = [p for p in local_head._processes_of(str(Path(temp_dir).resolve()), info.gcs_address)
                        if not local_head._is_zombie(p)]  # fmt: skip
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert leftover == []
