"""Gaps in a shard folder found by review, each pinned by the test that showed it: a shard deleted after the write,
a dataset.json whose num_classes disagrees with the folder, a built-in set's option it does not read, and a folder
that holds no shard-folder file at all."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from data_pipeline import validate as validate_cli
from data_pipeline.builtin import __main__ as builtin_cli
from data_pipeline.builtin.sets import BUILTIN_NAMES, unread_options
from data_pipeline.manifest import CLASSES_FILE, DATASET_FILE, ShardFormatError
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.shards import read_shard
from data_pipeline.stream.train_stream import TrainStream
from pretrain.config.train_config import load_config
from tests.data_pipeline.test_stream import jpeg_bytes

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12  # 3 epochs of 4 global batches: 4 shards of 16, 4 streams of one shard each, 4 samples a stream a step


@pytest.fixture
def shards(tiny_fractal_shards, tmp_path) -> Path:
    """A copy of the tiny fractal set (4 shards of 16 samples, 4 classes) that a test may damage."""
    return Path(shutil.copytree(tiny_fractal_shards, tmp_path / "fractal" / "train"))


def _set_num_classes(root: Path, num_classes: int) -> None:
    meta = json.loads((root / DATASET_FILE).read_text())
    (root / DATASET_FILE).write_text(json.dumps(dict(meta, num_classes=num_classes)))


def _stream(root: Path, num_workers: int = 0) -> TrainStream:
    config = DataConfig.for_stream(
        root, micro_batch_size=4, image_size=16, global_batch_size=16, streams=4, num_workers=num_workers
    )
    return TrainStream(config, record_keys=True)


def _keys(stream: TrainStream, steps: int) -> list[list[str]]:
    """The keys of ``steps`` global batches, one list per micro-batch (= one stream's chunk)."""
    return [list(stream.last_keys or []) for _ in itertools.islice(iter(stream), steps * 4)]


@pytest.mark.timeout(300)
def test_a_stream_dealt_only_a_missing_shard_reads_the_epochs_other_shards_and_the_rest_keep_their_order(shards):
    """A shard deleted after the write: an epoch whose deal gave a stream only that shard ended the run ("shards
    [...] hold no readable sample"), with the other shards readable. The stream now reads the epoch's other shards
    (a wrap, as for damage); the same order at any worker count and across a resume, and every other stream's
    samples are the intact folder's."""
    intact = _keys(_stream(shards), STEPS)
    gone = shards / "shard-000001.tar"
    lost = {s["__key__"] for s in read_shard(str(gone), 16, Counter())}
    gone.unlink()
    stream = _stream(shards)
    got = _keys(stream, STEPS)
    assert stream.stats["missing_shards"] > 0 and stream.stats["borrowing_streams"] == 3
    plan = stream.plan
    for micro, keys in enumerate(got):
        step, index = divmod(micro, 4)
        epoch = step // plan.steps_in_epoch(0)
        if plan.stream_shards(epoch)[index] == [1]:
            assert len(keys) == 4 and not lost & set(keys), (micro, keys)
        else:
            assert keys == intact[micro], micro
    assert _keys(_stream(shards, num_workers=2), STEPS) == got
    first = _stream(shards)
    assert _keys(first, 5) == got[:20]
    resumed = _stream(shards, num_workers=2)
    resumed.load_state_dict(first.state_dict())
    assert _keys(resumed, STEPS - 5) == got[20:]


def _sets(root: Path, run: Path) -> list[str]:
    return [
        f"data.train={root}",
        "data.builtin=null",
        "data.global_batch_size=8",
        "data.micro_batch_size=8",
        "data.streams=2",
        "model.num_classes=null",
        "schedule.total=4",
        "schedule.warmup=1",
        f"checkpoint.dir={run}",
        "checkpoint.every_steps=2",
        "logging.progress_bar=false",
        "deepspeed.precision=fp32",
        "evals.suite=null",
    ]


def _train(root: Path, run: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pretrain.train", "--config", "configs/local_demo.yaml"]
    args += [a for s in _sets(root, run) for a in ("--set", s)]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["missing_shard", "num_classes"])
def test_a_folder_that_contradicts_itself_is_refused_in_one_line_before_a_step(shards, tmp_path, train_env, damage):
    """A deleted shard trained partway and ended without a checkpoint (or, dealt beside a readable one, wrapped
    silently); a dataset.json num_classes of 2 beside 4 class names trained a 2-class head on half the data, exit 0.
    Both are now refused at the start: exit 2, one line naming the problem and the fix, no step trained."""
    if damage == "missing_shard":
        (shards / "shard-000001.tar").unlink()
        said = (
            f"{shards}: manifest.parquet lists 1 shard(s) that do not exist, e.g. {shards / 'shard-000001.tar'}; "
            f"check the folder with `python -m data_pipeline.validate {shards}` and write it again"
        )
    else:
        _set_num_classes(shards, 2)
        said = (
            f"{shards}: classes.parquet names 4 classes but dataset.json says num_classes 2; set it to 4 if the names "
            f"are right, or write the folder again (`python -m data_pipeline.validate {shards}` checks it)"
        )
    if damage == "num_classes":  # the stream's own start check, for a stream made outside pretrain.train
        with pytest.raises(ShardFormatError, match=f"^{said[:40]}"):
            _stream(shards)
    with pytest.raises(ShardFormatError) as refused:  # the recipe's validation: --dry-run and the plan say it too
        load_config("local_demo", _sets(shards, tmp_path / "run")).validate(1)
    assert str(refused.value) == said
    done = _train(shards, tmp_path / "run", train_env())
    assert (done.returncode, done.stderr.splitlines()[-1:]) == (2, [f"python -m pretrain.train: error: {said}"])
    assert "Traceback" not in done.stderr and "step 1/" not in done.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.timeout(120)
def test_labels_out_of_the_folders_range_are_said_once_on_the_console(shards, caplog):
    """Labels beyond a folder's num_classes (here without a classes.parquet to contradict it) were dropped with a
    counter in the stream state only; the stream now says so once, naming the count and the shard."""
    (shards / CLASSES_FILE).unlink()
    _set_num_classes(shards, 2)
    stream = _stream(shards, num_workers=2)
    with caplog.at_level(logging.WARNING, logger="data_pipeline.stream.train_stream"):
        _keys(stream, 3)
    said = [r.getMessage() for r in caplog.records if "outside [0, 2)" in r.getMessage()]
    assert len(said) == 1 and stream.stats["label_out_of_range"] > 0, caplog.text
    assert said[0].split(" sample(s) of shard ")[0].isdigit() and f"shard {shards}/shard-00000" in said[0]
    assert f"`python -m data_pipeline.validate {shards}`" in said[0]


def test_a_built_in_sets_option_it_does_not_read_is_refused(tmp_path, capsys):
    """``digits --set num_classes=8`` wrote digits at its 10 classes, exit 0: --set was checked against every
    built-in set's fields, not the set's own. It is now one line naming the fields the set reads; so is a recipe's
    data.builtin_options."""
    assert builtin_cli.main(["digits", "--out", str(tmp_path), "--set", "num_classes=8"]) == 2
    said = (
        "python -m data_pipeline.builtin: error: --set num_classes=8: digits does not read num_classes; the fields it "
        "reads: resolution, seed, num_test, samples_per_shard, processes\n"
    )
    assert capsys.readouterr().err == said and not (tmp_path / "digits").exists()
    config = DataConfig.for_stream(
        tmp_path / "digits" / "train", micro_batch_size=8, image_size=16, builtin="digits", builtin_options={}
    )
    config.check()
    with pytest.raises(ValueError, match=r"^data\.builtin_options\.num_classes: digits does not read it; the options"):
        replace(config, builtin_options={"num_classes": 8}).check()
    assert unread_options(BUILTIN_NAMES, {"num_classes": 8, "num_test": 3}) == []  # `all`: some set reads each


def test_validate_of_a_folder_without_any_shard_folder_file_says_it_is_not_one(tmp_path, capsys, tiny_fractal_shards):
    """An empty folder, or one of JPEGs, was called an interrupted write to run again; it is now not a shard folder,
    with how to write one. A folder holding the writer's files is still an interrupted write."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "jpegs").mkdir()
    (tmp_path / "jpegs" / "a.jpg").write_bytes(jpeg_bytes(0))
    for folder in ("empty", "jpegs"):
        assert validate_cli.main([str(tmp_path / folder)]) == 2
        said = (
            f"python -m data_pipeline.validate: error: {tmp_path / folder} is not a shard folder (it holds none of the "
            "files `python -m data_pipeline.write` writes: no dataset.json, manifest or shard); write one with `python "
            "-m data_pipeline.write --source ... --out DIR` or `python -m data_pipeline.builtin NAME --out DIR`\n"
        )
        assert capsys.readouterr().err == said
    (tmp_path / "begun").mkdir()
    shutil.copy(tiny_fractal_shards / "shard-000000.tar", tmp_path / "begun")
    assert validate_cli.main([str(tmp_path / "begun")]) == 2
    assert "has no dataset.json: it is not a complete shard folder (an interrupted write?)" in capsys.readouterr().err
