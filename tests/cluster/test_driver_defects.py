"""The Ray job's records on paths a multi-node, relaunched run takes (cluster.driver)."""

from __future__ import annotations

import json

from cluster.driver.eval_scheduler import task_options
from cluster.driver.record import count_restarts, record_placement
from cluster.local_head import free_port, in_process_cluster, ray_auth_mode
from cluster.profiles import load_profile


def test_a_run_launched_again_on_a_new_cluster_is_a_new_job_not_a_restart(tmp_path):
    """Ray numbers the jobs of each new cluster from 1: a run launched again after its cluster was brought up anew
    (`make stop`, `ray down`/`ray up`, a head that restarted) had its earlier job's id, and its first worker group was
    counted as a restart of that job (summary.json, `vitscale.restarts`, "restarted 1 time(s) after a worker
    failed"). The job's own start tells the jobs apart."""
    import ray

    with ray_auth_mode("disabled"):
        for job in (1000.0, 5000.0):  # two clusters: the same job id, and here the same pid on another node
            ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=100 * 1024**2)
            try:
                record_placement(tmp_path, 0, 1, job=job)
            finally:
                ray.shutdown()
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "workers").glob("rank0-*.json"))]
    # neither overwrote the other (the record's name holds the node as well as the rank and pid)
    assert sorted(r["job"] for r in records) == [1000.0, 5000.0] and len({r["node_id"] for r in records}) == 2
    written = records[0]
    assert written["job_id"] == records[1]["job_id"]

    first = {"rank": 0, "job_id": written["job_id"], "job": 1000.0, "world_size": 2}
    restarted = {**first, "started": 2.0}  # the first job lost a worker once
    again = {**first, "job": 5000.0, "started": 3.0}  # the run launched again on a new cluster: same job id
    assert count_restarts([{**first, "started": 1.0}, restarted, again]) == 1
    assert count_restarts([{**first, "started": 1.0}, again]) == 0


def test_an_eval_task_runs_on_the_eval_node_never_on_a_training_node_with_a_free_gpu(monkeypatch):
    """A profile with an eval node group (a100x64's g5.2xlarge): while Ray Train restarted the worker group, the
    training nodes' GPUs were free, and a waiting eval (1 GPU, 7 CPUs) fitted there; the new group then waited for it.
    Eval tasks ask for the resource only the eval nodes declare (cluster.render). Two nodes of real Ray: a "training"
    head with a GPU and CPUs to spare, an "eval" node with the resource."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    resources = load_profile("a100x64").evals.node_resources
    assert resources == {"vitscale_eval": 1} and load_profile("local").evals.node_resources == {}
    node_args = dict(object_store_memory=100 * 1024**2, include_dashboard=False)
    with ray_auth_mode("disabled"):
        cluster = in_process_cluster(**node_args, num_cpus=2, num_gpus=1, dashboard_agent_listen_port=free_port())
        try:
            eval_node = cluster.add_node(
                **node_args, num_cpus=1, resources={"vitscale_eval": 1000}, dashboard_agent_listen_port=free_port()
            )
            cluster.wait_for_nodes()
            ray.init(address=cluster.address)

            def where() -> str:
                return ray.get_runtime_context().get_node_id()

            options = task_options(1, 0, 0, resources)
            assert {ray.get(ray.remote(where).options(**options).remote()) for _ in range(4)} == {eval_node.node_id}
            # without it, the head's free CPUs (and GPU) would take it: what a training node offered
            head = cluster.head_node.node_id
            assert ray.get(ray.remote(where).options(**task_options(1, 1, 0)).remote()) == head
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_a_job_says_which_part_of_it_the_clusters_nodes_cannot_hold(monkeypatch):
    """A node group with no node up (no capacity for its instance type) left the job waiting without its word: Ray
    Train retries the worker group's start every minute for ever, and an eval task waits for an eval node; the job's
    end waited `evals.timeout_s` (an hour) for evals that could not start. Real Ray: two "training" nodes of 2 GPUs, an
    eval node added later."""
    import ray

    from cluster.driver.job import resource_shortfall

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    node_args = dict(object_store_memory=100 * 1024**2, include_dashboard=False)
    profile = load_profile("a100x64")  # 64 workers of 10 CPUs and 1 GPU; evals: 7 CPUs, 1 GPU, 12 GB, the eval node
    with ray_auth_mode("disabled"):
        cluster = in_process_cluster(**node_args, num_cpus=20, num_gpus=2, dashboard_agent_listen_port=free_port())
        try:
            cluster.add_node(**node_args, num_cpus=25, num_gpus=2, dashboard_agent_listen_port=free_port())
            cluster.wait_for_nodes()
            ray.init(address=cluster.address)
            workers, evals = resource_shortfall(profile, ray.nodes(), evals=True)
            assert workers.startswith(
                "the cluster's 2 live nodes hold 4 of the 64 training workers (CPU 10, GPU 1 each): Ray Train waits "
                "for nodes with these resources to join"
            ), workers
            assert evals.startswith(
                "no live node of the cluster can run an eval task (CPU 7, GPU 1, memory 12 GB, vitscale_eval 1): "
            ), evals
            assert resource_shortfall(profile, ray.nodes(), evals=False) == [workers]
            assert resource_shortfall(load_profile("local"), ray.nodes(), evals=True) == []  # 2 x 1 CPU; 1 CPU
            cluster.add_node(
                **node_args,
                num_cpus=8,
                num_gpus=1,
                memory=16 * 10**9,
                resources={"vitscale_eval": 1000},
                dashboard_agent_listen_port=free_port(),
            )
            cluster.wait_for_nodes()
            assert resource_shortfall(profile, ray.nodes(), evals=True) == [workers.replace("2 live", "3 live")]
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_a_ray_job_that_reached_stop_at_step_stays_stopped_in_mlflow(tmp_path, mlflow_uri):
    """The workers of a job that reached `schedule.stop_at_step` tag their run `vitscale.status=stopped`
    (pretrain.loop); the job's end, or its courier, then marked the run FINISHED and the tag "finished", so `make
    compare` ranked it with the runs that trained to the end of their schedules, with no note. A job that trained to
    the end stays finished."""
    from mlflow import MlflowClient

    from cluster.driver.courier import deliver
    from cluster.driver.record import JobEnd, finish_job
    from tracking import keys
    from tracking.report_collect import collect
    from tracking.runs import RUN_RECORD, create_run, run_tags
    from tracking.tracker import Tracker

    client = MlflowClient(tracking_uri=mlflow_uri)
    ended = {}
    for name, outcome in (("stop", "stopped"), ("courier", "stopped"), ("end", "finished")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        run_id = create_run(mlflow_uri, "ends", name, {}, run_tags("r", "vit_s16", 2))
        worker = Tracker(mlflow_uri, run_id, rank=0)  # rank 0, as pretrain.loop ends
        worker.set_tags({keys.STATUS: outcome})
        worker.close()
        if name == "courier":  # MLflow did not answer at the job's end
            (run_dir / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": mlflow_uri}))
            run = {"experiment": "ends", "config": {}, "tags": {}}
            assert deliver(run_dir, mlflow_uri, run, {}, "FINISHED", deadline_s=30) == run_id
        else:
            assert finish_job(run_dir, 1, mlflow_uri, run_id, JobEnd("FINISHED", 1.0, {}))
        run = client.get_run(run_id)
        ended[name] = (run.info.status, run.data.tags[keys.STATUS])
    assert ended == {
        "stop": ("FINISHED", "stopped"),
        "courier": ("FINISHED", "stopped"),
        "end": ("FINISHED", "finished"),
    }
    statuses = {r.run_name: r.status for r in collect(client, mlflow_uri, experiment="ends").runs}
    assert statuses == {"stop": "STOPPED", "courier": "STOPPED", "end": "FINISHED"}


def test_a_built_in_folder_of_other_settings_is_refused_before_ray_and_mlflow(tmp_path, capsys, monkeypatch):
    """`python -m cluster.driver --cluster local` on a built-in set generated at other settings: the job created its
    MLflow run and eval scheduler, then the folder's check raised a traceback, leaving the run RUNNING for good."""
    from cluster.driver.__main__ import main
    from data_pipeline.builtin import sets as builtin

    data = tmp_path / "data"
    builtin.ensure("rcdb", data, num_classes=4, images_per_class=8, val_per_class=1, samples_per_shard=2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    sets = [f"data.train={data}/rcdb/train", f"evals.data_root={data}", f"checkpoint.dir={tmp_path / 'run'}"]
    sets.append(f"logging.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}")
    argv = ["--cluster", "local", "--recipe", "local_demo", "--run-name", "x"]
    assert main([*argv, *(arg for s in sets for arg in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m cluster.driver: error: {data}/rcdb/train was generated with num_classes=4")
    assert err.count("\n") == 1 and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "run").exists()
