"""Shell exports that point Ray's own CLI (`ray job list|logs|submit|stop`) at a profile's cluster.

`python -m cluster.env [--cluster P]` backs `make env`: `vars=$(make -s env) && eval "$vars"` (a bare
`eval "$(make -s env)"` goes on after its error). The Jobs API's address (on `local` the running head's; no head:
exit 2) and RAY_AUTH_MODE (else Ray's CLI sends no token; a remote cluster's head runs with token auth,
`cluster.render`), with RAY_AUTH_TOKEN_PATH where the token is in another file; never the token.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from cluster import jobs, local_head
from cluster.profiles import ClusterProfile, load_profile
from data_pipeline.cli import fail


def _custom_token_path() -> str | None:
    """RAY_AUTH_TOKEN_PATH, resolved; None when unset or Ray's default ~/.ray/auth_token."""
    value = os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip()
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    return None if path == (Path.home() / ".ray" / "auth_token").resolve() else str(path)


def exports(profile: ClusterProfile) -> dict[str, str]:
    """The variables Ray's CLI needs; RayUnreachableError when no local head answers."""
    if not profile.is_local:  # cluster.render starts every remote head with RAY_AUTH_MODE=token
        jobs.refuse_local_head(profile, address := jobs.cluster_address(profile))
        return {"RAY_ADDRESS": address, **_token_exports("token")}
    state = local_head.read_state(profile)
    if state is None:
        raise jobs.RayUnreachableError(
            f"no Ray head of this project is running for profile {profile.name} (no {local_head.STATE_FILE} in "
            f"{profile.ray.temp_dir}); " + jobs._how_to_start(profile, "")
        )
    if not local_head.serves(state, state.dashboard_url):  # head.json outlives a killed head or a reboot
        raise jobs.RayUnreachableError(
            f"the Ray head of profile {profile.name} recorded in {profile.ray.temp_dir}/{local_head.STATE_FILE} does "
            f"not answer at {state.dashboard_url}; " + jobs._how_to_start(profile, state.dashboard_url)
        )
    return {"RAY_ADDRESS": state.dashboard_url, **_token_exports(state.auth_mode)}


def _token_exports(auth_mode: str) -> dict[str, str]:
    """RAY_AUTH_MODE, and where the token is when not in RAY_AUTH_TOKEN or Ray's default file; a warning without one."""
    found = {"RAY_AUTH_MODE": auth_mode}
    if auth_mode == "token":
        if token_path := _custom_token_path():
            found["RAY_AUTH_TOKEN_PATH"] = token_path
        if local_head.read_auth_token() is None:
            print(
                "warning: token authentication is on but no Ray token was found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, "
                "~/.ray/auth_token): the head will refuse the CLI",
                file=sys.stderr,
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.env", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="local", help="profile name (cluster/profiles/<name>.yaml) or YAML path")
    args = parser.parse_args(argv)
    try:
        found = exports(load_profile(args.cluster))
    except (ValueError, jobs.RayUnreachableError) as exc:
        return fail(parser.prog, exc)
    for name, value in found.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
