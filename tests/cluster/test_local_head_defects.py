"""cluster.local_head on a newcomer's machine: the checkout's path, two `make launch` at once. Real Ray heads, each in
a temp dir of the test's own, stopped by PID."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster import local_head
from cluster.local_head import free_port
from cluster.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]


def _profile(temp_dir: str):
    """The `local` profile with Ray's temp dir `temp_dir`, a free dashboard port and one CPU."""
    base = load_profile("local")
    ray = dataclasses.replace(base.ray, temp_dir=temp_dir, dashboard_port=free_port(), head_num_cpus=1)
    return dataclasses.replace(base, ray=ray)


def _leftover(profile) -> list[int]:
    """Stop every head under the profile's temp dir by PID; the processes left over."""
    local_head.stop_head(profile, grace_s=2.0)  # KILLs what outlives SIGTERM at once; the grace caps any other wait
    resolved = str(Path(profile.ray.temp_dir).resolve())
    link = local_head._short_link(Path(resolved))
    found = local_head._processes_of(resolved, None, link and str(link))
    return [p for p in found if not local_head._is_zombie(p)]


def _deep_temp_dir() -> tuple[Path, Path]:
    """(a scratch root, `{project}/.ray-local` of a checkout under it at a newcomer's depth: over about 25 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="vsd", dir="/tmp"))
    return root, root / "home/first.lastname/projects/vision/vitscale" / ".ray-local"


def test_a_deep_checkouts_link_taken_by_something_else_is_one_line_and_starts_nothing(monkeypatch):
    """Ray is given a short link to a temp dir too long for its Unix sockets (`_short_link`); where that name is
    something else's, the start stops with one line naming it and the fix, before anything runs."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    root, temp_dir = _deep_temp_dir()
    profile = _profile(str(temp_dir))
    link = local_head._short_link(temp_dir)
    assert link is not None and len(str(link)) <= local_head.MAX_TEMP_DIR_BYTES
    assert local_head._short_link(Path("/tmp/x/.ray-local")) is None  # a short one is Ray's as it is
    try:
        link.symlink_to(root)
        with pytest.raises(
            RuntimeError, match=rf"^Ray's temp dir .* is too long .* remove {link}, or set ray.temp_dir"
        ):
            local_head.ensure_head(profile, timeout_s=60)
        assert local_head.read_state(profile) is None and _leftover(profile) == []
    finally:
        link.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)


def _program(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


_ENSURE = (
    "import dataclasses, json, os; from cluster import local_head; from cluster.profiles import load_profile; "
    "base = load_profile('local'); "
    "ray = dataclasses.replace(base.ray, temp_dir=os.environ['TEMP_DIR'], dashboard_port=int(os.environ['PORT']), "
    "head_num_cpus=1); "
    "info = local_head.ensure_head(dataclasses.replace(base, ray=ray), timeout_s=120); "
    "print(json.dumps(dataclasses.asdict(info)))"
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_launches_at_once_from_a_deep_checkout_share_one_head(monkeypatch):
    """`make launch` in two terminals on a fresh checkout at a newcomer's depth. `{project}/.ray-local` over about 36
    bytes: Ray's sockets, <temp dir>/session_<time>_<pid>/sockets/dash_TaskEventsHead, exceeded the 107 bytes of a Unix
    socket's path and `ray start` failed with its traceback, after the data was generated; Ray is now given a short
    link to it, which `stop_head` removes, finding the processes that name it. Two at once: both found no head.json
    and started a head in the same temp dir; the one whose `ray start` lost the race for the dashboard port stopped
    "what its failed start left" by temp dir, the other's head included, or two heads ran, head.json naming one. Now
    the second waits for the first's head and reuses it."""
    root, temp_dir_path = _deep_temp_dir()
    temp_dir = str(temp_dir_path)
    link = local_head._short_link(temp_dir_path)
    assert link is not None
    profile = _profile(temp_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # the temp dir in the environment: a command line naming it is taken for one of the head's processes
    env.update(RAY_AUTH_MODE="disabled", TEMP_DIR=temp_dir, PORT=str(profile.ray.dashboard_port))
    cmd = [sys.executable, "-c", _ENSURE]
    try:
        launches = [
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        results = [p.communicate(timeout=280) for p in launches]
        for p, (_, err) in zip(launches, results):
            assert p.returncode == 0, err[-2000:]
        first, second = (local_head.HeadInfo(**json.loads(out.strip().splitlines()[-1])) for out, _ in results)
        assert first.gcs_address == second.gcs_address, "two heads were started"
        assert local_head.read_state(profile) == first and local_head.serves(first, first.dashboard_url)
        assert link.is_symlink() and link.resolve() == temp_dir_path.resolve()
        assert local_head._processes_of("no-such-dir", None, str(link))  # Ray's processes name the link
        ours = local_head._processes_of(str(temp_dir_path.resolve()), None, str(link))
        raylets = [p for p in ours if _program(p).endswith("/raylet")]
        assert len(raylets) == 1, raylets
        assert local_head.stop_head(profile) and not link.is_symlink()  # removed with the head
    finally:
        assert _leftover(profile) == []
        link.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_head_whose_folder_was_removed_under_it_is_still_stopped(monkeypatch, tmp_path, capsys):
    """`rm -r .ray-local` or `git clean -fdx` while the local head runs: head.json went with the folder, `make stop`
    said no head was running, and the head (its GCS and raylet outlive SIGTERM) held its port and CPUs until killed
    by hand. `make stop` finds its processes by the folder their command lines name."""
    from cluster import jobs

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp_dir = tmp_path / ".ray-local"
    profile = _profile(str(temp_dir))
    try:
        local_head.ensure_head(profile, timeout_s=120)
        shutil.rmtree(temp_dir)  # what `git clean -fdx` does to it
        assert local_head.read_state(profile) is None
        assert jobs._stop(profile) == 0
        said = capsys.readouterr().out
        assert said.startswith("stopped a local Ray head whose head.json was gone ("), said
        found = local_head._processes_of(str(temp_dir.resolve()))
        assert [p for p in found if not local_head._is_zombie(p)] == []
    finally:
        assert _leftover(profile) == []
