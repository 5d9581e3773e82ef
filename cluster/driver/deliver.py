"""A courier's work in the foreground, where no courier will do it (a `make stop` ended it, its 24 h passed, MLflow
refused the job's credentials): create the job's run, send its spool, late evals and final model, mark its status
(`cluster.driver.courier`; docs/design.md, "Tracking at a job's start"). Without a courier's work, the spool that
Trackers left for a run that exists (its server down as they closed) is sent.

    python -m cluster.driver.deliver RUN_FOLDER [--wait SECONDS]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cluster.driver.courier import deliver
from data_pipeline.cli import fail
from tracking.runs import RUN_RECORD, send_spooled
from tracking.store import COURIER_FILE, DELIVER_COMMAND, missing_run, recorded_run_id, spool_dir

COURIER_KEYS = ("tracking_uri", "run", "evals", "status")  # what `courier.hand_over` writes


def _read(path: Path) -> dict[str, Any]:
    """A JSON object this project wrote; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=DELIVER_COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("run_folder", help="the job's run folder (checkpoint.dir), e.g. runs/local_demo-20261204-0526")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for MLflow to answer (default 60)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_folder).resolve()
    record, state = run_dir / RUN_RECORD, run_dir / COURIER_FILE
    spooled = sorted(spool_dir(record).glob("*.json"))
    problem, work, run_id = None, None, None
    if not args.wait > 0:
        problem = f"--wait {args.wait:g}: give a positive number of seconds"
    elif not run_dir.is_dir():
        problem = f"{run_dir} is not a folder; pass a job's run folder (checkpoint.dir)"
    else:
        try:
            if state.exists():
                work = _read(state)
                if missing := [key for key in COURIER_KEYS if key not in work]:
                    raise ValueError(f"{state} lacks {', '.join(missing)}")
            elif spooled and (run_id := recorded_run_id(record, uri := _read(spooled[0]).get("tracking_uri"))) is None:
                problem = (
                    f"{run_dir} holds {len(spooled)} spool file(s) but its job never reached its end (no "
                    f"{COURIER_FILE}), so no run exists for them; launch the same run folder again: its end sends them"
                )
            elif spooled and run_id and (why := missing_run(uri, run_id)):
                problem = f"{why}; its {len(spooled)} spool file(s) stay in {spool_dir(record)}"
        except ValueError as error:
            problem = f"{error}; the job wrote it: delete it only to give up what it holds"
    if problem:
        return fail(DELIVER_COMMAND, problem)
    if work is not None:
        since = work.get("handed_over")
        run_id = deliver(run_dir, work["tracking_uri"], work["run"], work["evals"], work["status"], args.wait, since)
        return 0 if run_id else 1
    if not spooled:
        print(f"nothing in {run_dir} waits for MLflow")
        return 0
    sent, left = send_spooled(record, args.wait)
    print(f"MLflow run {run_id}: {sent} records sent, {left} spool file(s) left in {spool_dir(record)}")
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
