"""The MLflow UI over the project's tracking store, on 127.0.0.1: ``python -m tracking.ui [--port 5000]``.

The UI has no authentication and can delete runs: another ``--host`` is warned about.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
import warnings

from data_pipeline.cli import fail
from tracking.store import command_line_uri, default_store_help, is_sqlite, sqlite_path

LOOPBACK = "127.0.0.1"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    """ValueError naming the fix when ``host:port`` cannot be bound."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno not in (errno.EADDRINUSE, errno.EACCES):  # an address this machine does not have
                raise ValueError(
                    f"cannot listen on {_url_host(host)}:{port} ({error.strerror}): {host} is not an address of this "
                    "machine; leave out --host (127.0.0.1) or give one of its addresses"
                ) from error
            raise ValueError(
                f"cannot listen on {_url_host(host)}:{port} ({error.strerror}); another server uses it — "
                f"pass a free port, e.g. `python -m tracking.ui --port {port + 1}`"
            ) from error


def _url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def build_command(tracking_uri: str, host: str = LOOPBACK, port: int = 5000, workers: int = 1) -> list[str]:
    """The ``mlflow server`` command line; ValueError for a store that is not a local SQLite file."""
    db = sqlite_path(tracking_uri)
    if db is None:
        raise ValueError(
            f"tracking URI {tracking_uri!r} is not an embedded SQLite store; if it is an MLflow server, open it "
            "in a browser (through an SSH tunnel for a remote head) instead of starting another UI"
        )
    if not db.parent.is_dir():
        raise ValueError(f"folder of the tracking store {db} does not exist; run training first or fix the URI")
    if db.is_dir() or (db.is_file() and not is_sqlite(db)):  # else the server's 60-line traceback, exit 1
        what = "a folder" if db.is_dir() else "a file but not an SQLite database"
        raise ValueError(
            f"tracking store {db} is {what}; pass --tracking-uri sqlite:///<path>/mlflow.db (the project's store)"
        )
    if port <= 0 or port > 65535:
        raise ValueError(f"--port {port} is not a TCP port (1-65535)")
    server = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri]
    artifacts = ["--artifacts-destination", str(db.parent / "mlartifacts")]  # UI-created experiments' too
    return [*server, *artifacts, "--host", host, "--port", str(port), "--workers", str(workers)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracking.ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=5000, help="TCP port (default 5000)")
    parser.add_argument("--host", default=LOOPBACK, help="interface to bind (default 127.0.0.1, loopback only)")
    parser.add_argument("--tracking-uri", help=f"store to show ({default_store_help()})")
    parser.add_argument("--workers", type=int, default=1, help="server worker processes (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the server command and exit")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: give the number of server processes (>= 1)")

    try:
        uri = command_line_uri(args.tracking_uri)
        command = build_command(uri, args.host, args.port, args.workers)
        try:
            socket.getaddrinfo(args.host, args.port)
        except (socket.gaierror, UnicodeError) as error:  # say so, not "port taken"
            raise ValueError(
                f"--host {args.host!r} is not an address of this machine ({error}); omit it for 127.0.0.1"
            ) from None
        check_port_free(args.host, args.port)
    except ValueError as error:
        return fail(parser.prog, error)
    if not _is_loopback(args.host):
        warnings.warn(
            f"--host {args.host} exposes the MLflow UI (no authentication; it can delete runs) beyond this "
            "machine; prefer the default 127.0.0.1 and an SSH tunnel",
            stacklevel=1,
        )
    if sqlite_path(uri) is not None and not sqlite_path(uri).exists():
        print(f"tracking.ui: {sqlite_path(uri)} does not exist yet; the UI starts on an empty store")
    print(f"MLflow UI over {uri}: http://{_url_host(args.host)}:{args.port}  (Ctrl-C stops it)", flush=True)
    if args.dry_run:
        print(" ".join(command))
        return 0
    # MLflow 3's job runner (seven processes for GenAI jobs, never submitted here) is off unless asked for.
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.execv(command[0], command)  # Ctrl-C and `kill <pid>` reach the server directly
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
