"""``checkpoint.init_from`` in object storage, on a real GCS-compatible server (the ``gcs_endpoint`` fixture,
tests/conftest.py): two ranks start from a run folder's newest COMPLETE checkpoint in the bucket, fetched once into
the node's cache (`pretrain.checkpointer._fetched`), and train as they do from its local copy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from cluster.local_head import free_port
from pretrain import checkpointer
from pretrain.config.train_config import load_config
from pretrain.model.vit import model_config
from tests.pretrain.test_export import _checkpoint, _random
from tests.pretrain.test_train_distributed import tiny_config, torchrun

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_start_from_a_run_folder_in_a_bucket_as_from_its_local_copy(
    gcs_endpoint, tiny_fractal_shards, tmp_path, monkeypatch
):
    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "source"
    newest = _checkpoint(source, 2, _random(model_config("vit_tiny_debug", num_classes=10)))
    _checkpoint(source, 3, _random(model_config("vit_tiny_debug", num_classes=10, depth=1)), complete=False)
    fsspec.filesystem("gs").mkdir("vitscale-init")
    fsspec.filesystem("gs").put(str(source), "vitscale-init/runs/source", recursive=True)

    runs = {}
    for name, init_from in (("bucket", "gs://vitscale-init/runs/source"), ("local", str(newest))):
        sets = (f"checkpoint.init_from={init_from}", "schedule.total=3")
        config = tiny_config(tiny_fractal_shards, tmp_path / name, *sets)
        runs[name] = torchrun(config, tmp_path / f"w_{name}")
    for rank in (0, 1):
        assert runs["bucket"][rank]["start"] == runs["local"][rank]["start"] == "init_from"
        assert runs["bucket"][rank]["losses"] == runs["local"][rank]["losses"]  # bit for bit
    copies = [p.parent for p in Path(tmp_path / "cache").rglob(".fetched")]
    assert [c.name for c in copies] == ["step_00000002"]  # one copy, of the newest COMPLETE checkpoint


def test_weights_missing_from_the_bucket_are_one_message_naming_the_setting(gcs_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    fsspec.filesystem("gs").mkdir("vitscale-init")
    url = "gs://vitscale-init/runs/nothing-here"
    config = load_config("local_demo", [f"checkpoint.dir={tmp_path / 'run'}", f"checkpoint.init_from={url}"])
    with pytest.raises(ValueError, match=rf"^checkpoint\.init_from='{url}': {url}: nothing there"):
        checkpointer.find_start(config)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_store_that_refuses_is_said_to_refuse_not_to_hold_nothing(
    refusing_store, tmp_path, monkeypatch, capfd, scheme
):
    """A store answering 403 to everything (wrong credentials). fsspec's isfile/isdir answer False for it, so a fetch
    said "nothing there" (and gcsfs printed a warning per call); it now names the refusal, in one line."""
    from evals import run as evals_run
    from pretrain.weights import source

    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    url = f"{scheme}://vitscale-denied/runs/r"
    with pytest.raises(OSError, match=rf"^{url}: \w+: Forbidden") as raised:
        source.fetch(url)
    assert not isinstance(raised.value, FileNotFoundError)
    assert evals_run.main(["--checkpoint", url, "--suite", "local_fewshot"]) == 2
    out, err = capfd.readouterr()
    assert (
        err.count("\n") == 1 and f"python -m evals.run: error: checkpoint {url} could not be fetched: {url}: " in err
    ), err
    assert "nothing there" not in err


FETCH_ON_TWO_RANKS = """
import json, sys
import torch.distributed as dist
from pretrain import checkpointer
dist.init_process_group("gloo", init_method=sys.argv[2], rank=int(sys.argv[1]), world_size=2)
try:
    outcome = str(checkpointer._fetched(sys.argv[3]))
except ValueError as error:
    outcome = f"ValueError: {error}"
print(json.dumps(outcome))
"""


@pytest.mark.timeout(120)
def test_a_rank_whose_store_refuses_after_the_node_fetched_stops_every_rank_with_one_line(
    gcs_endpoint, refusing_store, tmp_path
):
    """Rank 0 fetches; rank 1 (not first on its node) then only looks the copy up, which lists the bucket again. Its
    refusal there raised on rank 1 alone: rank 0 went on into the next collective and waited for the timeout."""
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.json").write_text("{}")
    fsspec.filesystem("gs", endpoint_url=gcs_endpoint).mkdir("vitscale-init")
    fsspec.filesystem("gs", endpoint_url=gcs_endpoint).put(str(weights), "vitscale-init/weights", recursive=True)
    url, rendezvous = "gs://vitscale-init/weights", f"tcp://127.0.0.1:{free_port()}"
    ranks = []
    for rank, store in ((0, gcs_endpoint), (1, refusing_store)):
        env = {**os.environ, "STORAGE_EMULATOR_HOST": store, "LOCAL_RANK": str(rank)}
        env["VITSCALE_CACHE"] = str(tmp_path / "cache")
        command = [sys.executable, "-c", FETCH_ON_TWO_RANKS, str(rank), rendezvous, url]
        ranks.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outcomes = [rank.communicate(timeout=90) for rank in ranks]
    said = [json.loads(out.splitlines()[-1]) if out.strip() else err.decode()[-2000:] for out, err in outcomes]
    assert said[0] == said[1], said
    assert said[0].startswith(f"ValueError: checkpoint.init_from={url!r}: {url}: ") and "Forbidden" in said[0], said


# A fetch in a fresh interpreter, killed (os._exit, as by SIGKILL) when it would rename a fetched file into place.
FETCH_KILLED_BEFORE_RENAME = """
import os, sys
from pretrain.weights import source
def kill_at_rename(event, args):
    if event == "os.rename" and ".part" in str(args[0]):
        os._exit(9)
sys.addaudithook(kill_at_rename)
source.fetch(sys.argv[1])
"""


def test_a_killed_fetchs_partial_file_is_removed_by_the_next_fetch(gcs_endpoint, tmp_path, monkeypatch):
    """Each partial file is as big as the file it copies (2.5 GB for an H/14's weights); every killed fetch left one."""
    from pretrain.weights import source

    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.json").write_text("{}")
    fsspec.filesystem("gs").mkdir("vitscale-init")
    fsspec.filesystem("gs").put(str(weights), "vitscale-init/weights", recursive=True)
    url = "gs://vitscale-init/weights"
    command = [sys.executable, "-c", FETCH_KILLED_BEFORE_RENAME, url]
    killed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert killed.returncode == 9, killed.stderr
    assert [p.name for p in (tmp_path / "cache").rglob("*.part*")], "the kill left no partial file"
    copy = source.fetch(url)
    assert (copy / "model.json").read_text() == "{}"
    assert not list((tmp_path / "cache").rglob("*.part*"))
