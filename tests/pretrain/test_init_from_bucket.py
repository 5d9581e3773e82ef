"""``checkpoint.init_from`` in object storage, on a real GCS-compatible server (the ``gcs_endpoint`` fixture,
tests/conftest.py): two ranks start from a run folder's newest COMPLETE checkpoint in the bucket, fetched once into
the node's cache (`pretrain.checkpointer._fetched`), and train as they do from its local copy."""

from pathlib import Path

import fsspec
import pytest

from pretrain import checkpointer
from pretrain.config.train_config import load_config
from pretrain.model.vit import model_config
from tests.pretrain.test_export import _checkpoint, _random
from tests.pretrain.test_train_distributed import tiny_config, torchrun


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
