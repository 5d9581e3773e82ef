"""Ray Job Submission API: connect to a profile's cluster, submit, follow, and the `status/logs/stop` verbs.

`python -m cluster.jobs {status,logs,stop} --cluster P` backs `make status`, `make logs` and `make stop`.
Only this project's jobs (metadata `vitscale=1`) count. `stop` also stops the local head if we started it, and names
the run folders whose MLflow courier it ended with work left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from cluster import local_head
from cluster.profiles import ClusterProfile, load_profile, profile_names
from data_pipeline.cli import fail, interrupted
from tracking.store import COURIER_FILE, DELIVER_COMMAND

if TYPE_CHECKING:
    from ray.job_submission import JobDetails, JobSubmissionClient

PROG = "python -m cluster.jobs"  # `make status`, `make logs`, `make stop`
JOB_METADATA = {"vitscale": "1"}
PLAN_ENV = "VITSCALE_PLAN"  # = cluster.driver.job.PLAN_ENV (a slow import): the job's spec, in its runtime env
# The Jobs API's 500 while the head's job agent is unregistered (docs/design.md, "The local Ray head").
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 60.0
FOLLOW_LOST_S = 60.0  # `follow` gives up on a Jobs API silent this long
# `stop` waits this long for each stopped job to end before it stops the local head: the job's driver marks its MLflow
# run KILLED on the way out, and the head's end in between left the run RUNNING, tagged killed. Said after SAY_WAIT_S.
STOP_WAIT_S = 30.0
SAY_WAIT_S = 3.0


class RayUnreachableError(RuntimeError):
    """The profile's Ray cluster does not answer; the message says how to start it."""


class JobStoppedError(RayUnreachableError):
    """The Jobs API went away because `make stop` stopped the local head (its head.json gone): the job was stopped on
    purpose, not lost."""


class JobRefusedError(RuntimeError):
    """The Jobs API did not take a job: an HTTP error (a proxy's too), or the connection dropped; the message says
    which, in one line."""


def _how_to_start(profile: ClusterProfile, address: str) -> str:
    if profile.is_local:
        return "start it with `make launch` (CLUSTER=local starts the embedded head itself)"
    return (
        f"start the cluster first: `python -m cluster.render --cluster {profile.name}` then "
        f"`ray up rendered/{profile.name}/cluster.yaml`, and make sure {address} is reachable from here (e.g. "
        f"`ray dashboard rendered/{profile.name}/cluster.yaml` forwards it to 127.0.0.1:8265, then set "
        f"RAY_ADDRESS=http://127.0.0.1:8265); on Kubernetes, `kubectl apply -f rendered/{profile.name}/rayjob.yaml` "
        "runs the job itself, without a launch"
    )


def cluster_address(profile: ClusterProfile) -> str:
    """The Jobs API address; RAY_API_SERVER_ADDRESS or RAY_ADDRESS overrides a remote profile's, not `local`'s."""
    if profile.is_local:
        state = local_head.read_state(profile)
        return state.dashboard_url if state else ""
    return os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or profile.ray.address


def connect(profile: ClusterProfile, *, start_local: bool = False) -> JobSubmissionClient:
    """A client for the profile's cluster, with Ray's token; `start_local` starts or reuses the `local` head."""
    from ray.job_submission import JobSubmissionClient

    if profile.is_local:
        for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):  # they would override the address given below
            if os.environ.pop(var, None):
                print(f"note: {var} is ignored for the local profile", file=sys.stderr)
        if start_local:
            _ensure_local_head(profile)
    address = cluster_address(profile)
    head = local_head.read_state(profile) if profile.is_local and not start_local else None
    if head and not local_head.serves(head, address):  # stale: what answers there now is not our head
        address = ""
    if not address:
        raise RayUnreachableError(
            f"no Ray head of this project is running for profile {profile.name}; " + _how_to_start(profile, address)
        )
    refuse_local_head(profile, address)
    from ray.exceptions import RayError  # RpcError: an address without http:// is taken for a GCS one

    try:
        return JobSubmissionClient(address, headers=local_head.auth_headers())
    except ValueError as exc:  # an address Ray cannot parse (RAY_ADDRESS=garbage): name the form it takes
        named = next((v for v in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if os.environ.get(v)), "ray.address")
        raise ValueError(
            f"{named}={address!r} is no address Ray takes ({exc}); give the head's Jobs API, http://HEAD:8265 (its "
            "dashboard port), or ray://HEAD:10001"
        ) from None
    except (ConnectionError, RuntimeError, OSError, RayError) as exc:
        reason = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
        raise RayUnreachableError(
            f"cannot reach the Ray Jobs API of profile {profile.name} at {address}: {reason}; "
            + _how_to_start(profile, address)
        ) from exc


def refuse_local_head(profile: ClusterProfile, address: str) -> None:
    """RayUnreachableError where a remote profile's ``address`` is this project's running local head: it took the
    port the cluster's dashboard was to be forwarded to (`ray dashboard`), and its jobs are not the cluster's."""
    if profile.is_local or urlsplit(address).hostname not in ("127.0.0.1", "localhost", "::1"):
        return
    for name in profile_names():
        try:
            local = load_profile(name)
        except ValueError:
            continue
        head = local_head.read_state(local) if local.is_local else None
        if head and local_head.serves(head, address):
            fix = (
                "unset RAY_ADDRESS and RAY_API_SERVER_ADDRESS (`make env` exports the local head's)"
                if address != profile.ray.address
                else f"`make stop` stops it, or forward the cluster's dashboard to another port (`ray dashboard -p "
                f"8266 rendered/{profile.name}/cluster.yaml`, then RAY_ADDRESS=http://127.0.0.1:8266)"
            )
            raise RayUnreachableError(
                f"{address} is this project's local Ray head (profile {name}), not profile {profile.name}'s "
                f"cluster; {fix}"
            )


def _ensure_local_head(profile: ClusterProfile) -> local_head.HeadInfo:
    """`local_head.ensure_head`, its failures as RayUnreachableError."""
    from ray.exceptions import RayError  # e.g. AuthenticationError

    try:
        return local_head.ensure_head(profile)
    except (RuntimeError, OSError, RayError) as exc:
        raise RayUnreachableError(f"the local Ray head of profile {profile.name} is not ready: {exc}") from exc


def submit(
    client: JobSubmissionClient,
    entrypoint: str,
    runtime_env: dict,
    submission_id: str,
    agent_wait_s: float = AGENT_WAIT_S,
) -> str:
    """Submit with metadata vitscale=1; return the submission id. Only NO_AGENT is retried, for `agent_wait_s`, then
    RayUnreachableError; any other failure is JobRefusedError at once (a package too large for Ray: ValueError)."""
    with code_snapshot(runtime_env) as runtime_env:
        request = dict(
            entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id, metadata=dict(JOB_METADATA)
        )
        return _submit_counting_retries(client, request, agent_wait_s)[0]


@contextlib.contextmanager
def code_snapshot(runtime_env: dict) -> Iterator[dict]:
    """``runtime_env`` with its local ``working_dir`` folder packed once into a zip, the files Ray would pack (its
    default excludes, .gitignore and .rayignore, ``excludes``). Given the folder, Ray hashes it to name the package,
    then hashes it again to upload it: a file that changes in between (`make launch > launch.log` in the checkout, an
    editor saving) leaves the job a package name nothing was uploaded under, and the job fails setting up its runtime
    env. A zip is named by the hash of its bytes, the same both times. Ray's packing is Ray's own private function."""
    folder = runtime_env.get("working_dir")
    if not folder or not Path(folder).is_dir():
        yield runtime_env
        return
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import create_package

    excludes = ray_constants.get_runtime_env_default_excludes() + list(runtime_env.get("excludes") or [])
    gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"  # as Ray reads it
    with tempfile.TemporaryDirectory(prefix="vitscale-code-") as temp:
        package = Path(temp) / "code.zip"
        create_package(str(folder), package, include_gitignore=gitignore, excludes=excludes)
        packed = {key: value for key, value in runtime_env.items() if key != "excludes"}  # a zip ignores them
        yield {**packed, "working_dir": str(package)}


def _submit_counting_retries(client: JobSubmissionClient, request: dict, agent_wait_s: float) -> tuple[str, int]:
    """`client.submit_job(**request)`, retried on NO_AGENT: (submission id, retries)."""
    deadline = time.monotonic() + agent_wait_s
    retries = 0
    while True:
        try:
            return client.submit_job(**request), retries
        except OSError as exc:  # requests' ConnectionError: the connection dropped, e.g. while uploading the code
            raise _refused(client, request, exc) from exc
        except RuntimeError as exc:
            if "status code 500" not in str(exc) or NO_AGENT not in str(exc):
                raise _refused(client, request, exc) from exc
            if time.monotonic() >= deadline:
                raise RayUnreachableError(
                    f"Ray's job agent on the head did not register within {agent_wait_s:.0f} s, so the Jobs API "
                    f"refuses jobs ({exc}); see dashboard_agent.log in the head node's Ray logs "
                    "(<Ray temp dir>/session_latest/logs)"
                ) from exc
            if retries == 0:
                print(
                    f"Ray's job agent on the head is not registered yet; retrying for up to {agent_wait_s:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            retries += 1
            time.sleep(1.0)  # each refusal already took Ray's 10 s wait


def _refused(client: JobSubmissionClient, request: dict, exc: Exception) -> JobRefusedError:
    """``exc`` of a submission in one line: the head's traceback as its last line, an HTML error page as its text, the
    cure for a proxy's body limit."""
    text = str(exc)
    if "Traceback (most recent call last)" in text:  # the Jobs API's 500: the error is the traceback's last line
        error = [line for line in text.splitlines() if line.strip(" .")][-1]
        text = f"{text.split(':', 1)[0]}: {error}"
    reason = " ".join(re.sub(r"<[^>]*>", " ", text).split()).rstrip(". ")[:300] or type(exc).__name__
    if "status code 413" in reason:  # the working_dir upload: the checkout, a few MiB
        reason += (
            "; a proxy in front of the Jobs API limits the size of a request, and the job uploads its code: raise the "
            "limit (ingress-nginx: nginx.ingress.kubernetes.io/proxy-body-size) or forward the head's dashboard port "
            "(`ray dashboard`)"
        )
    return JobRefusedError(
        f"submitting job {request['submission_id']} to the Ray Jobs API at {client.get_address()} failed: {reason}"
    )


def follow(client: JobSubmissionClient, job_id: str, out=None, lost_s: float = FOLLOW_LOST_S) -> str:
    """Stream a job's logs to `out` (stdout) until it ends; return its final status. RayUnreachableError once the
    Jobs API has not answered for ``lost_s``; JobStoppedError as soon as it does not answer because its local head
    was stopped (`make stop`: its head.json gone)."""
    out = out or sys.stdout
    local = local_profile_at(client.get_address())

    async def _tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(_tail())
    except Exception as exc:  # fall back to polling: never lose the status
        print(f"(log streaming stopped: {exc}; polling the job status)", file=sys.stderr)
    silent_since, wait_s = None, 0.25  # the status lags the log's end by a moment: asked again soon, then every 2 s
    while True:
        try:
            status = client.get_job_status(job_id)
        except (OSError, RuntimeError) as exc:  # requests' ConnectionError is an OSError
            if silent_since is None:
                silent_since = time.monotonic()
            if local is not None and local_head.read_state(local) is None:  # stop_head removes it last
                raise JobStoppedError(
                    f"job {job_id} was stopped, and the local Ray head at {client.get_address()} with it (`make "
                    "stop`); launching the same run name again resumes the run"
                ) from None
            if time.monotonic() - silent_since >= lost_s:
                raise RayUnreachableError(
                    f"lost the Ray Jobs API at {client.get_address()} while following job {job_id}: no answer for "
                    f"{lost_s:g} s ({type(exc).__name__}); its head stopped or the network dropped. The job may "
                    "still run: once the head answers, `make status` shows it and `make logs` follows it"
                ) from None
        else:
            if status.is_terminal():
                if status.value == "FAILED" and (reason := _failed_before_running(client, job_id)):
                    print(f"job {job_id}: {reason}", file=out, flush=True)
                return str(status.value)
            silent_since = None
        time.sleep(min(wait_s, lost_s))
        wait_s = min(2.0, wait_s * 2)


def local_profile_at(address: str) -> ClusterProfile | None:
    """The `local` profile (cluster/profiles/) whose running head, as its head.json has it, serves the Jobs API at
    ``address``; None for any other address."""
    for name in profile_names():
        try:
            profile = load_profile(name)
        except ValueError:
            continue
        if profile.is_local and (head := local_head.read_state(profile)) and head.dashboard_url == address.rstrip("/"):
            return profile
    return None


def _failed_before_running(client: JobSubmissionClient, job_id: str) -> str:
    """`why_failed` of the job's message as the Jobs API has it; '' where it does not answer."""
    try:
        return why_failed(client.get_job_info(job_id).message)
    except (OSError, RuntimeError):
        return ""


def why_failed(message: str | None) -> str:
    """A FAILED job's reason in one line where its logs lack it, Ray having failed the job before its entrypoint ran
    (its runtime env: a pip install, the code's package; its supervisor): the message's first and last lines. ''
    where the entrypoint ran and failed: its own output says why."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines or lines[0].startswith("Job entrypoint command failed"):
        return ""
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def project_jobs(client: JobSubmissionClient) -> list[JobDetails]:
    jobs = [j for j in client.list_jobs() if (j.metadata or {}).get("vitscale") == "1"]
    return sorted(jobs, key=lambda j: j.start_time or 0)


def submission_id(run_name: str) -> str:
    """A launched job's id: it names the run, so that `unfinished_jobs_of` finds the job still writing its folder."""
    return f"vitscale-{run_name}-{int(time.time())}"


def unfinished_jobs_of(client: JobSubmissionClient, run_name: str) -> list[str]:
    """The ids of the jobs `cluster.launch` submitted for run ``run_name`` that have not ended; JobRefusedError where
    the Jobs API does not list its jobs."""
    own = re.compile(rf"vitscale-{re.escape(run_name)}-\d+")
    try:
        listed = project_jobs(client)
    except (OSError, RuntimeError) as exc:  # an HTTP error (a proxy's too), or the connection dropped
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        address = client.get_address()
        raise JobRefusedError(f"listing the jobs of the Ray Jobs API at {address} failed: {reason}") from exc
    return [j.submission_id for j in listed if own.fullmatch(j.submission_id or "") and not j.status.is_terminal()]


def _status(profile: ClusterProfile) -> int:
    jobs = project_jobs(connect(profile))
    print(f"profile {profile.name}: Ray Jobs API {cluster_address(profile)}")
    if not jobs:
        print("no vitscale jobs")
    for j in jobs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((j.start_time or 0) / 1000))
        print(f"{j.submission_id:40s} {str(j.status.value):10s} started {started}  {j.entrypoint}")
    return 0


def pick_job(jobs: list[JobDetails], profile: ClusterProfile, job_id: str | None) -> tuple[str, str]:
    """(the id, a line naming the job) of ``job_id`` among ``jobs`` (`project_jobs`), the newest without it: a
    colleague's job or a finished one may be the newest. ValueError where no such job is listed."""
    if job_id is None:
        job = jobs[-1]
    elif not (job := next((j for j in jobs if j.submission_id == job_id), None)):
        raise ValueError(
            f"no vitscale job {job_id} on profile {profile.name}'s cluster; `make status CLUSTER={profile.name}` "
            "lists them"
        )
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((job.start_time or 0) / 1000))
    line = f"job {job.submission_id}: {job.status.value}, started {started}"
    if run_dir := _run_folder(job):
        line += f", run folder {run_dir}"
    if job_id is None and len(jobs) > 1:
        line += (
            f" (the newest of {len(jobs)} vitscale jobs: `make status CLUSTER={profile.name}` lists them, `{PROG} "
            f"logs --cluster {profile.name} --job ID` shows another)"
        )
    return job.submission_id, line


def _run_folder(job: JobDetails) -> str | None:
    """The run folder in the job's spec (`cluster.driver.job.JobSpec`), None where it holds none."""
    try:
        spec = json.loads(((job.runtime_env or {}).get("env_vars") or {})[PLAN_ENV])
        return str(spec["config"]["checkpoint"]["dir"])
    except (KeyError, TypeError, ValueError):
        return None


def _logs(profile: ClusterProfile, follow_logs: bool, job_id: str | None = None) -> int:
    client = connect(profile)
    if not (jobs := project_jobs(client)):
        raise RayUnreachableError(f"no vitscale job on profile {profile.name}'s cluster yet; `make launch` submits one")
    job_id, line = pick_job(jobs, profile, job_id)
    print(line, flush=True)
    if follow_logs:
        print(f"job {job_id}: {follow(client, job_id)}")
    else:
        sys.stdout.write(client.get_job_logs(job_id))
        job = next(j for j in jobs if j.submission_id == job_id)
        if job.status.value == "FAILED" and (reason := why_failed(job.message)):
            print(f"job {job_id}: {reason}")
    return 0


def _stop(profile: ClusterProfile) -> int:
    if profile.is_local and not cluster_address(profile):
        # A head whose folder went under it (`rm -r .ray-local`, `git clean -fdx`) runs on, named by its processes'
        # command lines; stop_head finds them so.
        if pids := local_head.stop_head(profile):
            print(
                f"stopped a local Ray head whose head.json was gone ({len(pids)} processes of {profile.ray.temp_dir})"
            )
        else:
            print(f"nothing to stop: no Ray head of this project is running for profile {profile.name}")
        return 0
    client, running = None, []
    try:
        client = connect(profile)
    except RayUnreachableError as exc:
        print(f"no job to stop: {exc}")
    else:
        running = [j.submission_id for j in project_jobs(client) if not j.status.is_terminal()]
        if len(running) > 1 and not profile.is_local:  # which is yours? a colleague's may be the newest
            return fail(
                PROG,
                f"{len(running)} vitscale jobs run on profile {profile.name}'s cluster ({', '.join(running)}); "
                f'stop yours with `ray job stop ID` after `eval "$(make -s env CLUSTER={profile.name})"`',
            )
        for job_id in running:  # on `local`, the head's end would end them all anyway
            client.stop_job(job_id)
            print(f"stopped job {job_id}")
        if not running:
            print("no running vitscale job")
    if profile.is_local:
        state = local_head.read_state(profile)
        if state is not None and state.started_by_us:
            if client is not None:
                await_ends(client, running)
            pids = local_head.stop_head(profile)
            print(f"stopped the local Ray head ({len(pids)} processes under {profile.ray.temp_dir})")
            for line in undelivered_runs(profile):
                print(line)
    return 0


def await_ends(
    client: JobSubmissionClient, job_ids: list[str], wait_s: float = STOP_WAIT_S, say_after_s: float = SAY_WAIT_S
) -> None:
    """Wait up to ``wait_s`` in all until each job of ``job_ids`` is terminal (STOPPED, FAILED, SUCCEEDED): its
    driver's own shutdown done before the head it needs goes. One line where the wait outlasts ``say_after_s``, one
    where a job outlasts ``wait_s`` (the head is stopped anyway)."""
    deadline = time.monotonic() + wait_s
    say_at = time.monotonic() + say_after_s
    for job_id in job_ids:
        said, status = False, None
        while True:
            try:
                status = client.get_job_status(job_id)
            except (OSError, RuntimeError):  # no answer this time: asked again until the deadline
                status = None
            if status is not None and status.is_terminal():
                break
            if time.monotonic() >= deadline:
                state = status.value if status is not None else "not answering"
                print(f"job {job_id} still {state} after {wait_s:g} s; stopping the local Ray head anyway", flush=True)
                break
            if not said and time.monotonic() >= say_at:
                print(f"waiting up to {wait_s:g} s for job {job_id} to end its shutdown", flush=True)
                said = True
            time.sleep(0.25)


def undelivered_runs(profile: ClusterProfile) -> list[str]:
    """A line per run folder whose MLflow courier had work left (its work file): the head's end ended the courier."""
    root = Path(profile.storage.checkpoints)
    return [
        f"run folder {work.parent} holds MLflow records its courier had not sent; "
        f"`{DELIVER_COMMAND} {work.parent}` sends them"
        for work in sorted(root.glob(f"*/{COURIER_FILE}"))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=("status", "logs", "stop"))
    parser.add_argument("--cluster", default="local", help="profile name (cluster/profiles/<name>.yaml)")
    parser.add_argument("--follow", action="store_true", help="logs: stream until the job ends")
    parser.add_argument("--job", help="logs: the job's id (`make status` lists them; default: the newest)")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.cluster)
        if args.verb == "status":
            return _status(profile)
        if args.verb == "logs":
            return _logs(profile, args.follow, args.job)
        if not profile.is_local:  # an unreachable remote cluster exits 2; on `local`, nothing to stop is no error
            connect(profile)
        return _stop(profile)
    except (ValueError, RayUnreachableError) as exc:
        return fail(PROG, exc)
    except (OSError, RuntimeError) as exc:  # the Jobs API answered its version, then failed a call (an HTTP error)
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        return fail(
            PROG,
            f"the Ray Jobs API of profile {args.cluster} failed a request: {reason}; check the head (its dashboard "
            "log, `ray status` on it) and run the command again",
        )
    except KeyboardInterrupt:
        return interrupted(PROG, f"`make status CLUSTER={args.cluster}` shows the jobs")


if __name__ == "__main__":
    sys.exit(main())
