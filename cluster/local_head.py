"""The embedded Ray head of the `local` profile: start or reuse it (`ensure_head`), stop it (`stop_head`).

This venv's `ray` on 127.0.0.1 with token authentication (unless RAY_AUTH_MODE=disabled), ready once its job agent
has registered; it owns `profile.ray.temp_dir` (with `head.json`), whose processes `stop_head` kills by PID
(docs/design.md, "The local Ray head").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.profiles import ClusterProfile

STATE_FILE = "head.json"
LOCK_FILE = "head.lock"  # held while a head is started or reused: one head however many launches at once
# Ray's longest Unix socket under its temp dir (a dashboard module's, Ray 2.60; a 7-digit PID): a socket's path may
# not exceed 107 bytes on Linux, so a longer temp dir is given to Ray as a link to it (`_ray_temp_dir`)
RAY_SOCKET = "/session_2026-01-01_00-00-00_000000_4194304/sockets/dash_TaskEventsHead"
MAX_TEMP_DIR_BYTES = 107 - len(RAY_SOCKET)
NOT_READY_EXIT = 3  # the agent check timed out (1 is a crash)
PORTS_FROM = 20000  # Ray gives its workers ports 10002-19999 (ray start --max-worker-port)
_DRAW = random.SystemRandom()  # ports drawn without touching the global random state
PORT_TRIES = 3  # starts of the head when a port it was given is taken meanwhile
PORT_TAKEN = ("already occupied", "already in use")  # Ray's words for it (dashboard; GCS and others)
_AGENT_CHECK = (  # run in a child process by `_wait_for_job_agent`
    "import sys; from cluster.local_head import NOT_READY_EXIT, _job_agent_ready as ready; "
    "sys.exit(0 if ready(sys.argv[1], float(sys.argv[2])) else NOT_READY_EXIT)"
)
AGENT_LOG = "session_latest/logs/dashboard_agent.log"  # under the temp dir
# Ray's own processes that outlive SIGTERM and hold no work of a job's (`stop_head`): its daemons (executables, the
# autoscaler's monitor.py) and the actors that supervise jobs, whose entrypoint (a child of theirs) ends on SIGTERM
SIGTERM_DEAF = ("gcs_server", "raylet", "monitor.py")
JOB_SUPERVISOR = "ray::JobSupervisor"  # its process title, with ".method" while it runs one

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadInfo:
    gcs_address: str  # host:port for ray.init(address=...)
    dashboard_url: str  # the Jobs API, http://127.0.0.1:port
    temp_dir: str
    auth_mode: str  # "token" | "disabled"
    started_by_us: bool


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's range for outgoing connections and above Ray's worker
    ports; the kernel's pick if none is free."""
    for port in _DRAW.sample(range(PORTS_FROM, _outgoing_ports_start()), 64):
        if _port_free(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outgoing_ports_start() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return max(low, PORTS_FROM + 64)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def in_process_cluster(**head_args):
    """A `ray.cluster_utils.Cluster` with its head started, once the folder Ray writes `ray_current_cluster` to
    (whatever ``temp_dir`` says) exists. Its dashboard process (Ray starts one, a lean one without
    ``include_dashboard``) takes the first free port from 8265: given 8265 itself, as Ray's default is, it logged an
    ERROR where a head held that port (`make launch`'s, then `make elastic-demo`)."""
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    Path(get_default_ray_temp_dir()).mkdir(parents=True, exist_ok=True)
    return Cluster(initialize_head=True, head_node_args={"dashboard_port": None, **head_args})


def own_ray_vars(address: str) -> dict[str, str]:
    """The environment that points a job's processes' own Ray lookups at ``address``: Ray Train's placement-group
    cleaner otherwise asks the newest Ray on the machine whether the controller lives, and one that says no has the
    workers' placement group removed mid-training (docs/elastic.md, "Health checks")."""
    return {"RAY_ADDRESS": address}


def own_ray() -> None:
    """`own_ray_vars` as a ``worker_process_setup_hook``, for a Ray started in-process (``address="local"``)."""
    import ray

    os.environ.update(own_ray_vars(ray.get_runtime_context().gcs_address))


def auth_mode_from_env() -> str:
    """'disabled' only when RAY_AUTH_MODE says so; 'token' otherwise."""
    mode = os.environ.get("RAY_AUTH_MODE", "token").strip().lower()
    if mode not in ("token", "disabled"):
        raise ValueError(f"RAY_AUTH_MODE={mode!r}; use 'token' (default) or 'disabled' (tests only)")
    return mode


def ensure_auth_token(env: dict[str, str] | None = None) -> None:
    """Ray's token (`read_auth_token`), generated as `ray get-auth-token --generate` writes it if there is none."""
    if read_auth_token() is None:
        env = dict(os.environ if env is None else env, RAY_AUTH_MODE="token")
        subprocess.run(
            [_ray_executable(), "get-auth-token", "--generate"], env=env, check=True, stdout=subprocess.DEVNULL
        )


def read_auth_token() -> str | None:
    """The token Ray would use: RAY_AUTH_TOKEN, else the RAY_AUTH_TOKEN_PATH file, else ~/.ray/auth_token."""
    if token := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return token
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip() or Path.home() / ".ray" / "auth_token").expanduser()
    return (path.read_text().strip() or None) if path.is_file() else None


def auth_headers() -> dict[str, str]:
    """The Jobs API's Authorization header; empty with auth disabled or no token."""
    token = read_auth_token() if auth_mode_from_env() != "disabled" else None
    return {"Authorization": f"Bearer {token}"} if token else {}


def _ray_executable() -> str:
    exe = Path(sys.executable).with_name("ray")
    if not exe.exists():
        raise RuntimeError(f"{exe} not found: install Ray into this venv (`make setup`)")
    return str(exe)


def _get(url: str, timeout: float = 2.0) -> bytes | None:
    """The body of GET `url` with our auth header where it returns 200; else None."""
    req = urllib.request.Request(url, headers=auth_headers())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own head, or a loopback address
            return resp.read() if resp.status == 200 else None
    except (urllib.error.URLError, OSError, TimeoutError):
        return None


def _answers(url: str, timeout: float = 2.0) -> bool:
    """Whether GET `url`, with our auth header, returns 200."""
    return _get(url, timeout) is not None


def _dashboard_alive(url: str, timeout: float = 2.0) -> bool:
    return _answers(f"{url}/api/version", timeout)


def serves(info: HeadInfo, url: str, timeout: float = 2.0) -> bool:
    """Whether the Ray head answering at ``url`` is ``info``'s (its session), not what took the port since: head.json
    outlives a reboot or a killed head, and a `ray dashboard` tunnel to a cluster may sit on its port."""
    try:
        session = json.loads(_get(f"{url}/api/version", timeout) or "{}").get("session_name")
    except (ValueError, AttributeError):
        return False
    return session is not None and session == Path(info.temp_dir, "session_latest").resolve().name


def _registered_job_agent(gcs) -> str | None:
    """The head's job agent URL, None until registered; the GCS reads of Ray 2.60's `_get_head_node_agent_once`."""
    from ray._private import ray_constants
    from ray.dashboard import consts

    node_id = gcs.internal_kv_get(
        ray_constants.KV_HEAD_NODE_ID_KEY, namespace=ray_constants.KV_NAMESPACE_JOB, timeout=5
    )
    if not node_id:
        return None
    key = f"{consts.DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX}{node_id.decode()}".encode()
    value = gcs.internal_kv_get(key, namespace=ray_constants.KV_NAMESPACE_DASHBOARD, timeout=5)
    if not value:
        return None
    ip, http_port, _grpc_port = json.loads(value)
    return f"http://{ip}:{http_port}" if http_port > 0 else None  # -1: the agent's HTTP server failed to start


def _job_agent_ready(gcs_address: str, timeout_s: float) -> bool:
    """Poll, for at most `timeout_s`, until the job agent is registered and answers /api/healthz."""
    import ray.exceptions
    from ray._raylet import GcsClient

    gcs = GcsClient(address=gcs_address)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            url = _registered_job_agent(gcs)
        except ray.exceptions.RpcError:  # GCS busy: ask again
            url = None
        if url and _answers(f"{url}/api/healthz"):
            return True
        time.sleep(0.25)
    return False


def _wait_for_job_agent(info: HeadInfo, deadline: float) -> float:
    """Seconds waited until the job agent can take a job; RuntimeError at `deadline` (monotonic). A child process
    checks: this one would keep the auth mode in Ray's process-wide state."""
    start = time.monotonic()
    left = max(deadline - start, 1.0)
    cmd = [sys.executable, "-c", _AGENT_CHECK, info.gcs_address, f"{left:.1f}"]
    what = f"`{' '.join(cmd)}` (the wait for the Ray head's job agent)"
    env = dict(os.environ, RAY_AUTH_MODE=info.auth_mode)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left + 60)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what} hung; killed") from exc
    if proc.returncode == 0:
        return time.monotonic() - start
    if proc.returncode != NOT_READY_EXIT:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]  # the exception alone
        raise RuntimeError(f"{what} failed: {last}")
    raise RuntimeError(
        f"the Ray head's dashboard answers at {info.dashboard_url}, but its job agent did not register in GCS "
        f"({info.gcs_address}) and answer within {time.monotonic() - start:.0f} s, so Ray's Jobs API would refuse jobs "
        f"('No available agent to submit job'); see {Path(info.temp_dir) / AGENT_LOG}"
    )


def _state_path(profile: ClusterProfile) -> Path:
    return Path(profile.ray.temp_dir) / STATE_FILE


def read_state(profile: ClusterProfile) -> HeadInfo | None:
    path = _state_path(profile)
    try:
        return HeadInfo(**json.loads(path.read_text())) if path.is_file() else None
    except (ValueError, TypeError):
        return None


def ensure_head(profile: ClusterProfile, timeout_s: float = 120.0) -> HeadInfo:
    """Our running head, or a new one, once it can run a job; RuntimeError after `timeout_s` (a head started here is
    stopped)."""
    if not profile.is_local:
        raise ValueError(f"profile {profile.name} has ray.address={profile.ray.address!r}: only 'local' starts a head")
    temp_dir = Path(profile.ray.temp_dir)
    temp_dir.mkdir(parents=True, exist_ok=True)
    with open(temp_dir / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second launch waits for the first's head, then reuses it
        existing = read_state(profile)
        if existing and serves(existing, existing.dashboard_url):
            _wait_until_ready(profile, existing, time.monotonic() + timeout_s, started_here=False)
            return existing
        if existing:  # stale (reboot, killed head): clear what is left
            stop_head(profile)
        info = _start_head(profile, timeout_s)
        _wait_until_ready(profile, info, time.monotonic() + timeout_s, started_here=True)
        return info


def _start_head(profile: ClusterProfile, timeout_s: float) -> HeadInfo:
    """`ray start --head` on free ports (`PORT_TRIES` tries: one may be taken before Ray binds it), in head.json."""
    temp_dir = Path(profile.ray.temp_dir)
    temp_dir.mkdir(parents=True, exist_ok=True)
    mode = auth_mode_from_env()
    env = dict(os.environ, RAY_AUTH_MODE=mode, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)  # `ray start --head` must not join another cluster
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # a job's `python` is ours
    if mode == "token":
        ensure_auth_token(env)
    for attempt in range(1, PORT_TRIES + 1):
        gcs_port = free_port()
        dash_port = profile.ray.dashboard_port if _port_free(profile.ray.dashboard_port) else free_port()
        cmd = _ray_start_command(profile, _ray_temp_dir(temp_dir), gcs_port, dash_port)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:  # what it started runs on, with no head.json
            stop_head(profile)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise RuntimeError(f"`ray start --head` did not return within {timeout_s:.0f} s (a busy machine?)") from exc
        if proc.returncode == 0:
            break
        output = f"{proc.stdout}\n{proc.stderr}"
        if attempt == PORT_TRIES or not any(text in output for text in PORT_TAKEN):
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{output}")
        _log.warning("`ray start --head`: a port was taken while Ray started; starting again on other ports")
        stop_head(profile)  # what the failed start left running (it wrote no head.json)
    info = HeadInfo(f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dash_port}", str(temp_dir), mode, started_by_us=True)
    _state_path(profile).write_text(json.dumps(asdict(info), indent=2))
    return info


def _short_link(temp_dir: Path) -> Path | None:
    """The link in /tmp that Ray is given for ``temp_dir`` where that is too long for Ray's Unix sockets (a checkout
    path over about 25 bytes); None where it is short enough."""
    real = Path(temp_dir).resolve()
    if len(bytes(real)) <= MAX_TEMP_DIR_BYTES:
        return None
    return Path(f"/tmp/vsray-{os.getuid()}-{hashlib.sha256(bytes(real)).hexdigest()[:8]}")  # 30 bytes at most


def _ray_temp_dir(temp_dir: Path) -> Path:
    """``temp_dir``, or its `_short_link`, made here (`stop_head` removes it): a link of ours to it, or RuntimeError."""
    link = _short_link(temp_dir)
    if link is None:
        return temp_dir
    real = temp_dir.resolve()
    with contextlib.suppress(FileExistsError):
        link.symlink_to(real, target_is_directory=True)
    if not link.is_symlink() or link.lstat().st_uid != os.getuid() or link.resolve() != real:
        raise RuntimeError(
            f"Ray's temp dir {real} is too long for Ray's Unix sockets (<temp dir>{RAY_SOCKET} may not exceed 107 "
            f"bytes), and {link}, the link to it Ray would be given, is something else; remove {link}, or set "
            f"ray.temp_dir in the profile to a folder of your own of at most {MAX_TEMP_DIR_BYTES} bytes"
        )
    return link


def _ray_start_command(profile: ClusterProfile, temp_dir: Path, gcs_port: int, dash_port: int) -> list[str]:
    return [
        _ray_executable(),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs_port}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash_port}",
        "--include-dashboard=true",
        f"--ray-client-server-port={free_port()}",  # free ports: another Ray may hold the defaults
        f"--dashboard-agent-listen-port={free_port()}",
        f"--num-cpus={profile.ray.head_num_cpus}",
        "--num-gpus=0",
        f"--object-store-memory={profile.ray.head_object_store_mb * 1024 * 1024}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]


def _wait_until_ready(profile: ClusterProfile, info: HeadInfo, deadline: float, started_here: bool) -> None:
    """Wait for the dashboard, then the job agent; RuntimeError at `deadline` (a head started here is stopped)."""
    start = time.monotonic()
    try:
        while not _dashboard_alive(info.dashboard_url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray head started but its dashboard {info.dashboard_url} never answered")
            time.sleep(0.25)  # a refused connection costs nothing; the launch waits less
        dashboard_s = time.monotonic() - start
        agent_s = _wait_for_job_agent(info, deadline)
    except RuntimeError:
        if started_here:
            stop_head(profile)
        raise
    _log.info(
        "Ray head %s: dashboard answered in %.1f s, job agent %.1f s after that", info.gcs_address, dashboard_s, agent_s
    )


def _processes_of(temp_dir: str, gcs_address: str | None = None, link: str | None = None) -> list[int]:
    """PIDs naming our temp dir (or the `_short_link` to it Ray was given), their descendants (workers rename
    themselves), and the head's Ray Client proxy, found by our GCS port: it names no temp dir and outlives the head."""
    parents: dict[int, int] = {}
    found: set[int] = set()
    gcs_port = None if gcs_address is None else gcs_address.rsplit(":", 1)[-1]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        ours = (
            temp_dir in cmdline
            or (link is not None and link in cmdline)
            or (gcs_port is not None and "ray.util.client.server" in cmdline and _address_port(cmdline) == gcs_port)
        )
        if ours and pid != os.getpid():
            found.add(pid)
    while grown := {p for p, pp in parents.items() if pp in found and p not in found and p != os.getpid()}:
        found |= grown
    return sorted(found)


def _address_port(cmdline: str) -> str | None:
    """The port of ``--address=host:port`` (the host is the node's IP, not 127.0.0.1)."""
    return next((arg.rsplit(":", 1)[-1] for arg in cmdline.split() if arg.startswith("--address=")), None)


def stop_head(profile: ClusterProfile, grace_s: float = 10.0) -> list[int]:
    """Stop the head we started, by PID; return the PIDs signalled. A reused head is left alone."""
    state = read_state(profile)
    if state is not None and not state.started_by_us:
        return []
    temp_dir = str(Path(profile.ray.temp_dir).resolve())
    link = _short_link(Path(temp_dir))
    gcs_address = state.gcs_address if state else None
    stopped: list[int] = []
    deadline = time.monotonic() + grace_s
    # Re-scan until nothing is left: a raylet shutting down can still spawn a worker after a scan.
    while alive := [p for p in _processes_of(temp_dir, gcs_address, link and str(link)) if not _is_zombie(p)]:
        # Ray's processes left alone after a SIGTERM (all else ended, a job's driver too: nothing to flush) are KILLed
        # now: the GCS, the monitor, job supervisors, sometimes the raylet ignore it, and the whole grace was waited
        # out (10 s a `make stop`)
        hard = time.monotonic() >= deadline or (bool(stopped) and all(map(_outlives_sigterm, alive)))
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if hard else signal.SIGTERM)
        stopped.extend(p for p in alive if p not in stopped)
        if hard and time.monotonic() >= deadline + grace_s:
            break  # unkillable (stuck in the kernel): do not hang `make stop`
        time.sleep(0.25)
    _state_path(profile).unlink(missing_ok=True)
    if link is not None and link.is_symlink() and link.resolve() == Path(temp_dir):
        link.unlink(missing_ok=True)
    return stopped


def _outlives_sigterm(pid: int) -> bool:
    """Whether ``pid`` is one of Ray's processes that outlive SIGTERM (`SIGTERM_DEAF`, `JOB_SUPERVISOR`)."""
    try:
        args = [arg.decode(errors="replace") for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3]]
    except OSError:
        return True  # gone
    return args[0].startswith(JOB_SUPERVISOR) or any(Path(arg).name in SIGTERM_DEAF for arg in args)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@contextlib.contextmanager
def ray_auth_mode(mode: str) -> Iterator[None]:
    """RAY_AUTH_MODE=``mode`` in the environment and in Ray's process-wide state while the block runs, for clusters
    started in this process (docs/elastic.md, "Health checks"). No Ray session may be connected on entry."""
    import ray
    from ray._raylet import AuthenticationTokenLoader, Config

    def follow_environment() -> None:  # as Ray's tests do: the config first, so nothing reloads the old token
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()

    if ray.is_initialized():
        raise RuntimeError("ray_auth_mode: a Ray session is connected in this process; call ray.shutdown() first")
    try:
        with environ({"RAY_AUTH_MODE": mode}):
            follow_environment()
            yield
    finally:
        follow_environment()


@contextlib.contextmanager
def environ(values: dict[str, str | None]) -> Iterator[None]:
    """``values`` in os.environ while the block runs (None: unset), the old values back after it."""
    saved = {key: os.environ.get(key) for key in values}
    _set_environ(values)
    try:
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
