"""The Ray job's records on paths a multi-node, relaunched run takes (cluster.driver)."""

from __future__ import annotations

import json

from cluster.driver.record import count_restarts, record_placement


def test_a_run_launched_again_on_a_new_cluster_is_a_new_job_not_a_restart(tmp_path):
    """Ray numbers the jobs of each new cluster from 1: a run launched again after its cluster was brought up anew
    (`make stop`, `ray down`/`ray up`, a head that restarted) had its earlier job's id, and its first worker group was
    counted as a restart of that job (summary.json, `vitscale.restarts`, "restarted 1 time(s) after a worker
    failed"). The job's own start tells the jobs apart."""
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=100 * 1024**2)
    try:
        record_placement(tmp_path, 0, 1, job=1000.0)
    finally:
        ray.shutdown()
    [written] = [json.loads(p.read_text()) for p in (tmp_path / "workers").glob("rank0-*.json")]
    assert written["job"] == 1000.0 and written["job_id"]

    first = {"rank": 0, "job_id": written["job_id"], "job": 1000.0, "world_size": 2}
    restarted = {**first, "started": 2.0}  # the first job lost a worker once
    again = {**first, "job": 5000.0, "started": 3.0}  # the run launched again on a new cluster: same job id
    assert count_restarts([{**first, "started": 1.0}, restarted, again]) == 1
    assert count_restarts([{**first, "started": 1.0}, again]) == 0
