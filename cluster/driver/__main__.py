"""The Ray job's entry point: read the job spec `cluster.launch` wrote, join the cluster, run the job.

python -m cluster.driver [--plan SPEC.json] [--address ADDR]     # the plan defaults to $VITSCALE_PLAN
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cluster.driver.job import PLAN_ENV, JobSpec, run_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.driver", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help=f"job spec JSON written by cluster.launch (default: ${PLAN_ENV})")
    parser.add_argument("--address", default=None, help="Ray address (default: the job's cluster)")
    args = parser.parse_args(argv)
    if not args.plan and not os.environ.get(PLAN_ENV):
        parser.error(f"no plan: pass --plan FILE or set ${PLAN_ENV} (python -m cluster.launch does)")
    source = f"--plan {args.plan}" if args.plan else f"${PLAN_ENV}"
    try:  # unreadable, not JSON, JSON of another shape, an invalid profile or config
        text = Path(args.plan).read_text() if args.plan else os.environ[PLAN_ENV]
        spec = JobSpec.from_json(text)  # the job's one build of the config, before Ray and MLflow start
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        print(
            f"python -m cluster.driver: error: {source} is not a job spec ({type(error).__name__}: {error}); the spec "
            f"is the JSON that `python -m cluster.launch` writes into ${PLAN_ENV} of the Ray job it submits",
            file=sys.stderr,
        )
        return 2
    import ray  # heavy: deferred

    try:  # here, not in run_job: no cluster is the user's to fix, not a crash
        ray.init(address=args.address or "auto")
    except ConnectionError as error:
        print(
            f"python -m cluster.driver: error: no Ray cluster at {args.address or 'auto'} ({error}); the driver runs "
            "as a Ray job: start it with `python -m cluster.launch` (make launch), or pass --address of a running head",
            file=sys.stderr,
        )
        return 2
    import psutil  # a Ray dependency; the driver process's start begins the goodput ledger

    return run_job(spec, address=args.address, started_at=psutil.Process().create_time())


if __name__ == "__main__":
    sys.exit(main())
