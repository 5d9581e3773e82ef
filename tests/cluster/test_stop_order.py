"""`make stop` on `local` (`cluster.jobs._stop`) against a real local Ray head: a stopped job's driver ends its own
shutdown (it marks its MLflow run KILLED) before the head it needs is stopped, and a `make launch` following the job
ends at once, saying the job was stopped."""

from __future__ import annotations

import contextlib
import io
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cluster import jobs, local_head, profiles
from cluster.profiles import ClusterProfile, load_profile
from tests.cluster.test_jobs import _job, _local_profile_file, _ray_temp_dir, _token_auth

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

# A driver that, SIGTERMed by Ray's `stop_job`, takes 1.5 s to shut down (Ray KILLs it after 3), then writes whether
# the head's dashboard port still answers: `cluster.driver`'s `_interrupted` needs the head to finish marking its run.
SLOW_SHUTDOWN = """
import os, signal, socket, sys, time
from urllib.parse import urlsplit

def shut_down(*_):
    time.sleep(1.5)
    url = urlsplit(os.environ["HEAD_URL"])
    try:
        socket.create_connection((url.hostname, url.port), timeout=2).close()
        seen = "head up"
    except OSError:
        seen = "head gone"
    with open(os.environ["MARK"], "w") as f:
        f.write(seen)
    sys.exit(0)

signal.signal(signal.SIGTERM, shut_down)
open(os.environ["READY"], "w").close()
while True:
    time.sleep(1)
"""


def _await_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written in {timeout_s} s"
        time.sleep(0.25)


def _follow(client: JobSubmissionClient, job_id: str, ended: list) -> None:
    """`jobs.follow`'s status or exception into ``ended``."""
    try:
        ended.append(jobs.follow(client, job_id, out=io.StringIO()))
    except Exception as exc:
        ended.append(exc)


@contextlib.contextmanager
def _local_head(monkeypatch, tmp_path: Path) -> Iterator[tuple[ClusterProfile, JobSubmissionClient]]:
    """Our own local head (token auth, a private temp dir, free ports): (its profile, a client), stopped after."""
    _token_auth(monkeypatch, tmp_path)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    temp_dir = _ray_temp_dir()
    profile = load_profile(_local_profile_file(tmp_path / "local_test.yaml", temp_dir))
    try:
        yield profile, jobs.connect(profile, start_local=True)
    finally:
        local_head.stop_head(profile, grace_s=2.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stop_waits_for_the_stopped_jobs_shutdown_before_stopping_the_local_head(monkeypatch, tmp_path, capsys):
    """Reviewer's r5d: `make stop` stopped the head right after `stop_job`, and the driver, still marking its MLflow
    run KILLED, lost the head in between (the run stayed RUNNING, tagged killed). The head now outlives the job's
    shutdown."""
    mark, ready, ended = tmp_path / "mark", tmp_path / "ready", []
    monkeypatch.setattr(profiles, "PROFILES_DIR", tmp_path)  # where `follow` finds the head's profile, local_test
    with _local_head(monkeypatch, tmp_path) as (profile, client):
        env = {"HEAD_URL": local_head.read_state(profile).dashboard_url, "MARK": str(mark), "READY": str(ready)}
        request = {**_job("vitscale-slow-stop"), "entrypoint": f"python -c '{SLOW_SHUTDOWN}'"}
        client.submit_job(**{**request, "runtime_env": {"env_vars": env}})
        _await_file(ready, 120)
        capsys.readouterr()
        follower = threading.Thread(target=_follow, args=(client, "vitscale-slow-stop", ended), daemon=True)
        follower.start()  # `make launch` following the job in another terminal
        assert jobs._stop(profile) == 0
        out = capsys.readouterr().out
        assert "stopped job vitscale-slow-stop\n" in out and "stopped the local Ray head" in out
        _await_file(mark, 15)  # on the old code, written (if ever: the head's end may kill it) after the head went
        assert mark.read_text() == "head up"
        # The follower ends at once, the stop said as one: not after 60 s silence as a lost Jobs API.
        follower.join(30)
        assert not follower.is_alive(), "follow still waits on the stopped head"
        assert ended == ["STOPPED"] or (
            len(ended) == 1
            and isinstance(ended[0], jobs.JobStoppedError)
            and str(ended[0]).startswith("job vitscale-slow-stop was stopped, and the local Ray head at ")
        ), ended


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stops_wait_for_a_job_is_bounded_and_said(monkeypatch, tmp_path, capsys):
    """A job still not ended: one line once the wait outlasts a few seconds, one when it outlasts its bound (the head
    is stopped anyway), then the wait returns."""
    with _local_head(monkeypatch, tmp_path) as (_, client):
        client.submit_job(**{**_job("vitscale-sleeper"), "entrypoint": "python -c 'import time; time.sleep(600)'"})
        started = time.monotonic()
        jobs.await_ends(client, ["vitscale-sleeper"], wait_s=2.0, say_after_s=0.5)
        assert time.monotonic() - started < 15
        out = capsys.readouterr().out
        assert "waiting up to 2 s for job vitscale-sleeper to end its shutdown\n" in out
        assert "job vitscale-sleeper still " in out and "after 2 s; stopping the local Ray head anyway\n" in out
        client.stop_job("vitscale-sleeper")
        jobs.await_ends(client, ["vitscale-sleeper"])
        assert client.get_job_status("vitscale-sleeper").is_terminal()
