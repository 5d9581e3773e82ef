"""What the writer reads from a source, and how each skip is counted: the labels of splits written one at a time,
unreadable folders and files, links in per-class tars, sources it must not guess; and validate's store errors."""

from __future__ import annotations

import json
import logging
import os
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline import validate as validate_cli
from data_pipeline.write import __main__ as write_cli
from data_pipeline.write.readers import open_source
from tests.data_pipeline.test_write import class_tars, encoded, smooth_image


def class_folders(root: Path, classes: dict[str, int]) -> Path:
    """``root`` with ``classes[name]`` distinct images in each class sub-folder."""
    for c, (name, count) in enumerate(classes.items()):
        (root / name).mkdir(parents=True)
        for i in range(count):
            (root / name / f"{i}.jpg").write_bytes(encoded(smooth_image(500 + 10 * c + i)))
    return root


def write(source: Path, out: Path, *more: str) -> int:
    return write_cli.main(["--source", str(source), "--out", str(out), "--processes", "1", *more])


def labels(out: Path) -> tuple[list[dict], dict[str, int]]:
    """(classes.parquet's rows, each sample's label by its source's class folder)."""
    samples = pq.read_table(out / "samples.parquet").to_pylist()
    return pq.read_table(out / "classes.parquet").to_pylist(), {r["source"].split("/")[0]: r["label"] for r in samples}


def test_a_split_without_a_class_keeps_the_labels_of_the_splits_written_beside_it(tmp_path, capsys):
    """val (no goldfish) written after train got tench=0 shark=1 where train has tench=0 goldfish=1 shark=2, without
    a word; with a space-separated 'id name' map, val was refused with advice to give 'id name' lines."""
    train = class_folders(tmp_path / "src" / "train", {"n01": 2, "n02": 2, "n03": 2})
    val = class_folders(tmp_path / "src" / "val", {"n01": 1, "n03": 1})
    (tmp_path / "names.txt").write_text("n01 tench\nn02 goldfish\nn03 shark\n")
    names = ["--class-names", str(tmp_path / "names.txt")]
    out = tmp_path / "out"
    assert write(train, out / "train", "--split", "train", *names) == 0
    assert write(val, out / "val", "--split", "val", *names) == 0
    said = capsys.readouterr().out
    assert "no image in 1 of the classes (kept, so labels stay): goldfish" in said
    assert f"labels: the 3 classes of the split folders beside {out / 'val'}, by class id" in said
    assert labels(out / "val") == (labels(out / "train")[0], {"n01": 0, "n03": 2})
    assert write(val, out / "val", "--split", "val", *names) == 0  # a re-run is the same run
    assert "scanned 2 images, wrote 2" in capsys.readouterr().out
    # a class the other splits lack: refused before --out exists
    other = class_folders(tmp_path / "src" / "test", {"n01": 1, "n04": 1})
    assert write(other, out / "test", "--split", "test") == 2
    err = capsys.readouterr().err
    assert "--source has classes that the split folder" in err and "lacks (n04); labels are the same" in err
    assert err.count("\n") == 1 and not (out / "test").exists()
    # no split beside it: the map of more classes than the source holds names its classes
    assert write(val, tmp_path / "alone" / "val", "--split", "val", *names) == 0
    assert labels(tmp_path / "alone" / "val") == ([{"label": 0, "name": "tench"}, {"label": 1, "name": "shark"}],) + (
        {"n01": 0, "n03": 1},
    )


def test_a_split_with_more_classes_than_the_one_beside_it_is_refused(tmp_path, capsys):
    small = class_folders(tmp_path / "src" / "val", {"cat": 1, "eel": 1})
    full = class_folders(tmp_path / "src" / "train", {"cat": 1, "dog": 1, "eel": 1})
    assert write(small, tmp_path / "out" / "val", "--split", "val") == 0
    assert write(full, tmp_path / "out" / "train", "--split", "train") == 2
    err = capsys.readouterr().err
    assert f"delete {tmp_path / 'out' / 'val'}, write this split, then that one again" in err
    assert write(full, tmp_path / "out" / "other", "--split", "val") == 0  # the same split name: another dataset


def refuse_listing(monkeypatch, refused: set[Path]) -> None:
    """``os.scandir`` of ``refused`` folders raises as for a folder of another user's, mode 700 (tests run as
    root, who reads every folder)."""
    scandir = os.scandir

    def listing(path="."):
        if Path(path) in refused:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", listing)


def test_unreadable_folders_are_counted_and_an_unreadable_class_named(tmp_path, monkeypatch, capsys):
    """Path.rglob passes over a folder it cannot list: its images were dropped with "skipped none", and a class
    folder that could not be read was named as one with no image."""
    source = class_folders(tmp_path / "src", {"cat": 2, "dog": 2, "eel": 2})
    (source / "cat" / "sub").mkdir()
    (source / "cat" / "sub" / "a.jpg").write_bytes(encoded(smooth_image(900)))
    refuse_listing(monkeypatch, {source / "cat" / "sub", source / "eel"})
    assert write(source, tmp_path / "out") == 0
    out = capsys.readouterr().out
    assert "skipped {'unreadable_classes': 1, 'unreadable_folders': 1}" in out
    assert "1 class folders cannot be read, their images skipped" in out and out.rstrip().endswith("): eel")
    assert "no image in" not in out


def test_an_unreadable_image_is_counted_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A file of another user's (mode 600) raised PermissionError from the scan: a traceback, an empty --out."""
    source = class_folders(tmp_path / "src", {"cat": 2, "dog": 2})
    locked = source / "dog" / "1.jpg"
    read_bytes = Path.read_bytes

    def read(path: Path) -> bytes:
        if path == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", read)
    assert write(source, tmp_path / "out") == 0
    assert "scanned 3 images, wrote 3 in 1 shards" in (out := capsys.readouterr().out) and "{'unreadable': 1}" in out


def test_symlinks_and_hardlinks_in_class_tars_are_counted_and_not_followed(tmp_path, capsys):
    source = class_tars(tmp_path / "src", ["n01", "n02"], per_class=2)
    with tarfile.open(source / "n01.tar", "a") as tar:
        for kind, target in ((tarfile.SYMTYPE, "/etc/passwd"), (tarfile.LNKTYPE, "n01_0.JPEG")):
            info = tarfile.TarInfo(f"link{kind.decode()}.JPEG")
            info.type, info.linkname = kind, target
            tar.addfile(info)
    assert write(source, tmp_path / "out") == 0
    assert "wrote 4 in 1 shards" in (out := capsys.readouterr().out) and "skipped {'tar_links': 2}" in out


def parquet_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image": [encoded(smooth_image(0)), encoded(smooth_image(1))], "label": [0, 1]}), path)
    return path


def test_class_tars_beside_a_parquet_file_ask_for_kind(tmp_path, capsys):
    """Every tar was dropped: the folder was read as Parquet only."""
    source = class_tars(tmp_path / "src", ["n01", "n02"], per_class=1)
    parquet_file(source / "extra.parquet")
    assert write(source, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"--source {source} holds both per-class .tar files (n01.tar, n02.tar) and .parquet files" in err
    assert "--kind imagenet21k or --kind parquet" in err and err.count("\n") == 1 and not (tmp_path / "out").exists()
    assert write(source, tmp_path / "out", "--kind", "imagenet21k") == 0


def test_a_hugging_face_snapshot_names_its_parquet_folder(tmp_path, capsys):
    """Read as one image class called "data", then "no valid images"."""
    parquet_file(tmp_path / "hf" / "data" / "train-00000-of-00001.parquet")
    (tmp_path / "hf" / "README.md").write_text("---\n")
    assert write(tmp_path / "hf", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "holds .parquet files one level down, in data/ (a Hugging Face dataset snapshot?)" in err
    assert err.rstrip().endswith(f"pass --source {tmp_path / 'hf' / 'data'}") and not (tmp_path / "out").exists()
    assert write(tmp_path / "hf" / "data", tmp_path / "out") == 0
    classes = class_folders(tmp_path / "src", {"cat": 1, "dog": 1})
    parquet_file(classes / "cat" / "stray.parquet")  # beside images: a class folder, read as before
    assert write(classes, tmp_path / "out2") == 0


@pytest.mark.parametrize("option", ["--source", "--out", "--exclude-like"])
def test_an_empty_path_is_refused_not_the_current_folder(tmp_path, monkeypatch, capsys, option):
    """`--out ""` wrote into the current folder, `--source ""` read it."""
    source = class_folders(tmp_path / "src", {"cat": 1, "dog": 1})
    monkeypatch.chdir(tmp_path / "src")
    argv = {"--source": str(source), "--out": str(tmp_path / "out"), option: ""}
    assert write_cli.main([*(x for kv in argv.items() for x in kv), "--processes", "1"]) == 2
    assert (
        capsys.readouterr().err.rstrip().endswith(f"error: {option} is empty; give a path (`.` for the current folder)")
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"] and sorted(os.listdir()) == ["cat", "dog"]


def test_space_separated_id_name_lines_of_more_classes_name_the_classes(tmp_path):
    source = class_folders(tmp_path / "src", {"cat": 1, "eel": 1})
    (tmp_path / "names.txt").write_text("cat Katze\ndog Hund\neel Aal\n")
    assert open_source(source, class_names_file=tmp_path / "names.txt").class_names == ("Katze", "Aal")


def test_validate_without_store_credentials_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """A 30-line botocore NoCredentialsError traceback, exit 1 (which says "damaged")."""
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        assert validate_cli.main(["s3://vitscale-no-bucket/train"]) == 2
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    err = capsys.readouterr().err
    assert "(NoCredentialsError: Unable to locate credentials)" in err and "set AWS_ACCESS_KEY_ID" in err
    assert err.count("\n") == 1


def test_validate_keeps_the_store_clients_retry_tracebacks_quiet(monkeypatch, capsys, caplog):
    """gcsfs logged each failed try, with a traceback, before validate's one line."""

    def unreachable(*args, **kwargs):
        logging.getLogger("gcsfs").error("retrying", exc_info=OSError("no network"))
        raise OSError("Cannot connect to host storage.googleapis.com:443")

    monkeypatch.setattr(validate_cli, "validate", unreachable)
    with caplog.at_level(logging.DEBUG):
        assert validate_cli.main(["gs://vitscale-no-bucket/train"]) == 2
    assert not [r for r in caplog.records if r.name == "gcsfs"]
    assert capsys.readouterr().err.count("\n") == 1


def test_a_run_stopped_before_its_first_shard_keeps_nothing_that_refuses_a_changed_source(tmp_path, capsys):
    """Its half-written .tmp shard counted as a shard: the corrected source was refused, where the stop had said
    "no shard was finished; the same command starts over"."""
    source = class_folders(tmp_path / "src", {"cat": 2, "dog": 2})
    out = tmp_path / "out"
    assert write(source, out) == 0
    for file in out.iterdir():  # as a run stopped in its first shard leaves it
        if file.name != "_write_settings.json":
            file.unlink()
    (out / "shard-000000.tar.tmp").write_bytes(b"half a shard")
    (source / "dog" / "9.jpg").write_bytes(encoded(smooth_image(999)))
    assert write(source, out) == 0
    assert "wrote 5 in 1 shards" in capsys.readouterr().out and not list(out.glob("*.tmp"))


def test_validate_names_a_damaged_samples_table_and_says_damaged(tmp_path, capsys):
    """It exited 2 with "a metadata file is damaged", naming none."""
    source = class_folders(tmp_path / "src", {"cat": 2, "dog": 2})
    assert write(source, tmp_path / "out") == 0
    samples = tmp_path / "out" / "samples.parquet"
    samples.write_bytes(samples.read_bytes()[:100])
    capsys.readouterr()
    assert validate_cli.main([str(tmp_path / "out")]) == 1
    assert "   - samples.parquet is damaged (Parquet magic bytes not found" in capsys.readouterr().out


def test_exclude_like_a_bucket_url_is_named_as_given(tmp_path, capsys):
    """`s3://b/x` was named `s3:/b/x`, as neither a shard folder nor a folder of images."""
    source = class_folders(tmp_path / "src", {"cat": 1, "dog": 1})
    assert write(source, tmp_path / "out", "--exclude-like", "s3://b/x") == 2
    err = capsys.readouterr().err
    assert "error: --exclude-like s3://b/x: object storage is not read here; copy" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_an_exclusion_folder_with_a_folder_that_cannot_be_listed_is_refused(tmp_path, monkeypatch, capsys):
    """`--exclude-like` of an evaluation image folder passed over a sub-folder it could not list (rglob): its images
    would pass into the training set unchecked, without a word. Refused, as an unreadable image there already is."""
    source = class_folders(tmp_path / "src", {"cat": 1, "dog": 1})
    evals = class_folders(tmp_path / "evals", {"cat": 1, "dog": 1})
    refuse_listing(monkeypatch, {evals / "dog"})
    assert write(source, tmp_path / "out", "--exclude-like", str(evals)) == 2
    err = capsys.readouterr().err
    assert f"error: --exclude-like {evals}: cannot list {evals / 'dog'} (Permission denied); make it" in err
    assert err.count("\n") == 1


def test_validate_does_not_advise_running_validate(tmp_path, capsys):
    """A count that disagrees with the manifest (here negative) said "run `python -m data_pipeline.validate` for
    details" from validate itself, which stops at the same check."""
    source = class_folders(tmp_path / "src", {"cat": 1, "dog": 1})
    assert write(source, tmp_path / "out") == 0
    meta = json.loads((tmp_path / "out" / "dataset.json").read_text())
    (tmp_path / "out" / "dataset.json").write_text(json.dumps(meta | {"num_samples": -3}))
    assert validate_cli.main([str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "dataset.json says -3 samples but manifest.parquet counts 2; the folder is damaged" in err
    assert "python -m data_pipeline.write" in err and "data_pipeline.validate`" not in err


def test_a_source_without_a_valid_image_leaves_no_out_folder(tmp_path, capsys):
    """The refusal came after --out was created: an empty folder was left."""
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "a.jpg").write_bytes(b"not an image")
    assert write(tmp_path / "src", tmp_path / "out") == 2
    assert "error: no valid images to write" in capsys.readouterr().err and not (tmp_path / "out").exists()
