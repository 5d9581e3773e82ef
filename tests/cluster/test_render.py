"""cluster.render: the `ray up` YAML passes Ray's own config schema; the KubeRay RayJob matches the profile."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster import render


@pytest.mark.timeout(120)
def test_a100x64_launcher_yaml_validates_with_rays_schema(tmp_path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    launcher, rayjob = render.render("a100x64", "vit_h14_i21k", tmp_path)
    config = yaml.safe_load(launcher.read_text())
    validate_config(prepare_config(config))  # Ray's ray-schema.json after Ray fills its defaults; raises if invalid

    types = config["available_node_types"]
    assert types["head"]["node_config"]["InstanceType"] == "p4de.24xlarge"  # the 80 GB A100 part
    assert types["gpu_worker"]["min_workers"] == types["gpu_worker"]["max_workers"] == 7  # head + 7 = 8 nodes
    assert types["head"]["resources"]["GPU"] == types["gpu_worker"]["resources"]["GPU"] == 8
    assert types["eval_worker"]["resources"]["GPU"] == 1  # evals never take a training GPU
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "RAY_AUTH_MODE=token" in head_start

    docs = list(yaml.safe_load_all(rayjob.read_text()))
    job, policy = docs
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["entrypoint"] == "python -m cluster.driver"
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert groups["gpu"]["replicas"] == 7
    head_limits = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    assert head_limits["limits"]["nvidia.com/gpu"] == "8"
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    env = runtime_env["env_vars"]
    spec = json.loads(env["VITSCALE_PLAN"])
    # Shards on s3://: the nodes install the s3 extra, and so does the job (for an image without it).
    assert "pip install -e '/fsx/vitscale[s3]'" in config["setup_commands"]
    assert runtime_env["pip"] == ["s3fs>=2024.2"] and spec["plan"]["data"]["storage_extras"] == ["s3"]
    assert spec["plan"]["topology"]["world_size"] == 64 and spec["config"]["model"]["name"] == "vit_h14"
    assert spec["config"]["checkpoint"]["dir"].startswith("/fsx/")
    assert policy["kind"] == "NetworkPolicy"


@pytest.mark.timeout(60)
def test_render_refuses_the_local_profile(capsys):
    with pytest.raises(ValueError, match="needs no cluster files"):
        render.launcher_config(render.load_profile("local"))
    assert render.main(["--cluster", "local"]) == 2
    assert render.main(["--cluster", "nope"]) == 2
    assert "valid profiles" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_gcs_shards_install_the_gcs_extra(tmp_path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    data = yaml.safe_load((render.load_profile.__globals__["PROFILES_DIR"] / "a100x8.yaml").read_text())
    data["storage"]["shards"] = "gs://vitscale-datasets"
    profile = tmp_path / "a100x8_gcs.yaml"
    profile.write_text(yaml.safe_dump(data))
    launcher, rayjob = render.render(str(profile), "vit_b16_i21k", tmp_path / "out")
    config = yaml.safe_load(launcher.read_text())
    validate_config(prepare_config(config))
    assert "pip install -e '/fsx/vitscale[gcs]'" in config["setup_commands"]
    job = next(yaml.safe_load_all(rayjob.read_text()))
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env["pip"] == ["gcsfs>=2024.2"]
    assert json.loads(runtime_env["env_vars"]["VITSCALE_PLAN"])["config"]["data"]["train"].startswith("gs://")
