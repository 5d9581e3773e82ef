"""Damaged input: exact skip counts or clear errors, and nothing valid lost."""

from __future__ import annotations

import io
import os
import signal
import tarfile
import threading
from collections import Counter

import pyarrow.parquet as pq
import pytest

from data_pipeline import validate as validate_cli
from data_pipeline.manifest import MANIFEST_FILE, ShardFormatError, read_dataset_info
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.stream.train_stream import TrainStream
from data_pipeline.write import __main__ as write_cli
from data_pipeline.write import writer
from data_pipeline.write.readers import open_source
from tests.data_pipeline.test_stream import UNEVEN, jpeg_bytes, make_shards

CORRUPT_KEY = "000010"


def corrupt_one(key, index, sample):
    if key == CORRUPT_KEY:
        sample["jpg"] = sample["jpg"][: len(sample["jpg"]) // 3]  # a truncated JPEG: header fine, data cut
    return sample


def eval_keys(root, **kw):
    stream = EvalStream(root, batch_size=16, image_size=16, return_keys=True, **kw)
    return [k for _, _, keys in stream for k in keys], stream


def test_corrupt_jpeg_is_skipped_and_counted_exactly(tmp_path):
    root = make_shards(tmp_path / "c", member=corrupt_one)
    keys, stream = eval_keys(root, num_workers=2)
    assert stream.stats["corrupt_samples"] == 1
    assert sorted(keys) == [f"{k:06d}" for k in range(sum(UNEVEN)) if f"{k:06d}" != CORRUPT_KEY]
    train = TrainStream(DataConfig.for_stream(root, micro_batch_size=8, image_size=16, num_workers=0, shuffle_buffer=0))
    it = iter(train)
    for _ in range(train.steps_per_epoch):
        next(it)
    assert train.stats["corrupt_samples"] == 1  # every sample was drawn once this epoch; the bad one once
    assert validate_cli.main([str(root), "--full"]) == 1


def test_truncated_shard_is_counted_not_silently_shortened(tmp_path, capsys):
    root = make_shards(tmp_path / "t")
    big = root / "shard-000003.tar"  # 40 samples
    data = big.read_bytes()
    cut = len(data) // 2
    with tarfile.open(big) as tar:  # a sample cut inside has some of its members whole (read), not all
        members = tar.getmembers()
    whole = Counter(m.name.split(".")[0] for m in members if m.offset_data + m.size <= cut)
    every = Counter(m.name.split(".")[0] for m in members)
    partial = [key for key, n in whole.items() if n < every[key]]
    big.write_bytes(data[:cut])
    keys, stream = eval_keys(root)
    lost = sum(UNEVEN) - len(keys)
    assert 0 < lost < 40
    # Every lost sample is counted: read in part (incomplete) or never reached (missing), none twice.
    assert stream.stats["truncated_shards"] == 1 and stream.stats["incomplete_samples"] == len(partial)
    assert stream.stats["missing_samples"] == lost - len(partial)
    others = {f"{k:06d}" for k in range(sum(UNEVEN))} - {f"{k:06d}" for k in range(3 + 17 + 5, 3 + 17 + 5 + 40)}
    assert others <= set(keys)  # every sample of the intact shards is still there
    train = TrainStream(
        DataConfig.for_stream(root, micro_batch_size=8, image_size=16, num_workers=2, shuffle_buffer=4), world_size=1
    )
    batches = [b for _, b in zip(range(train.steps_per_epoch), train)]
    assert len(batches) == train.steps_per_epoch  # the epoch keeps its length (wrapping), and says why
    assert train.stats["truncated_shards"] >= 1
    assert train.stats["wrapped_samples"] > 0  # its stream re-read its shards to fill the epoch: counted
    assert validate_cli.main([str(root)]) == 1
    assert "shard-000003.tar" in capsys.readouterr().out


def unsafe_member_shard(root):
    """A shard with a member named ../x.jpg besides two good samples, and its manifest."""
    root = make_shards(root, sizes=[2])
    shard = root / "shard-000000.tar"
    with tarfile.open(shard, "a") as tar:
        payload = jpeg_bytes(99)
        info = tarfile.TarInfo("../x.jpg")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return root


def test_tar_member_with_parent_path_is_never_extracted(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    root = unsafe_member_shard(tmp_path / "u" / "train")
    keys, stream = eval_keys(root)
    assert keys == ["000000", "000001"] and stream.stats["unsafe_members"] == 1
    assert not list(tmp_path.rglob("x.jpg"))  # nothing written next to or above the shard or the cwd


def test_writer_skips_unsafe_members_of_a_source_tar(tmp_path):
    src = tmp_path / "i21k"
    src.mkdir()
    with tarfile.open(src / "n0001.tar", "w") as tar:
        for name, data in (("n0001_1.JPEG", jpeg_bytes(1)), ("../evil.JPEG", jpeg_bytes(2))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    report = writer.write_dataset(tmp_path / "out", writer.WriteConfig(processes=1), source=open_source(src))
    assert report.written == 1 and report.skipped == {"unsafe_member": 1}
    assert not (tmp_path / "evil.JPEG").exists()


def test_empty_source_folder_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is empty"):
        open_source(tmp_path / "empty")
    assert write_cli.main(["--source", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "is empty" in capsys.readouterr().err


def test_a_source_that_is_no_collection_says_what_it_is_and_how_to_lay_it_out(tmp_path, capsys):
    """A folder of loose images, or one image given as --source, used to be called "empty"; a cut Parquet file was
    refused without its name."""
    (tmp_path / "loose").mkdir()
    for i in range(3):
        (tmp_path / "loose" / f"IMG_{i}.JPG").write_bytes(jpeg_bytes(i))
    (tmp_path / "cut.parquet").write_bytes(b"PAR1" + bytes(40))
    a_file = "is a file, not a folder or a .parquet file; give a folder of class sub-folders"
    wanted = [
        (
            "loose",
            "auto",
            f"holds 3 images but no class sub-folders; put each class's images in a sub-folder named "
            f"after the class ({tmp_path / 'loose'}/CLASS/IMAGE)",
        ),
        ("loose/IMG_0.JPG", "auto", a_file),
        ("loose/IMG_0.JPG", "folder", a_file),  # was a NotADirectoryError traceback
        ("cut.parquet", "auto", "is not a readable Parquet file ("),
    ]
    for source, kind, says in wanted:
        argv = ["--source", str(tmp_path / source), "--kind", kind, "--out", str(tmp_path / "o")]
        assert write_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m data_pipeline.write: error: ") and f"{tmp_path / source} {says}" in err, err
        assert err.count("\n") == 1


def test_label_out_of_range_is_skipped_and_counted(tmp_path):
    def bad_label(key, index, sample):
        if index in (4, 50):
            sample["cls"] = b"99"
        return sample

    root = make_shards(tmp_path / "l", member=bad_label)
    keys, stream = eval_keys(root)
    assert stream.stats["label_out_of_range"] == 2 and len(keys) == sum(UNEVEN) - 2
    assert validate_cli.main([str(root), "--full"]) == 1


def test_ctrl_c_in_validate_is_one_line_and_exit_130(tmp_path, capsys):
    """Ctrl-C while validate waits on a shard (here a stalled one: a FIFO no one writes, as a hung mount) used to
    print a traceback. A real SIGINT to the main thread; the writer end opens after 5 s, so no run can hang."""
    root = make_shards(tmp_path / "s")
    stalled = root / "shard-000001.tar"
    stalled.unlink()
    os.mkfifo(stalled)
    main_thread = threading.main_thread().ident
    ctrl_c = threading.Timer(0.2, signal.pthread_kill, (main_thread, signal.SIGINT))
    unblock = threading.Timer(5, lambda: os.close(os.open(stalled, os.O_WRONLY)))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        ctrl_c.start(), unblock.start()
        try:
            code = validate_cli.main([str(root)])
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C escaped validate as a traceback")
    finally:
        signal.signal(signal.SIGINT, previous)
        ctrl_c.cancel(), unblock.cancel()
    assert code == 130
    said = (
        "python -m data_pipeline.validate: interrupted; "
        f"nothing in {root} is half-written; the same command checks it again\n"
    )
    assert capsys.readouterr().err == said


def test_parquet_label_beyond_class_names_is_a_clear_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [jpeg_bytes(0), jpeg_bytes(1)], "label": [0, 5]}), tmp_path / "d.parquet")
    names = tmp_path / "names.txt"
    names.write_text("cat\ndog\n")
    with pytest.raises(ValueError, match="out of range"):
        open_source(tmp_path / "d.parquet", class_names_file=names)


def test_missing_manifest_is_a_clear_error(tmp_path, capsys):
    root = make_shards(tmp_path / "m")
    (root / MANIFEST_FILE).unlink()
    with pytest.raises(ShardFormatError, match="has no manifest.parquet"):
        read_dataset_info(root)
    with pytest.raises(ValueError, match="has no manifest.parquet"):
        TrainStream(DataConfig.for_stream(root, micro_batch_size=2, image_size=16))
    assert validate_cli.main([str(root)]) == 2
    assert "manifest.parquet" in capsys.readouterr().err
    with pytest.raises(ShardFormatError, match="does not exist"):
        read_dataset_info(tmp_path / "nowhere")


def test_validate_of_a_dataset_folder_names_its_split_folders(tmp_path, capsys):
    """A dataset's folder (data/digits, holding train/ and test/) was called an interrupted write to run again."""
    for split in ("train", "test"):
        make_shards(tmp_path / "digits" / split, sizes=[2])
    (tmp_path / "digits" / "notes").mkdir()
    assert validate_cli.main([str(tmp_path / "digits")]) == 2
    said = (
        f"{tmp_path / 'digits'} holds the split folders test, train of a dataset, not shards; give one of them, "
        f"e.g. {tmp_path / 'digits' / 'test'}"
    )
    assert capsys.readouterr().err == f"python -m data_pipeline.validate: error: {said}\n"
    with pytest.raises(ShardFormatError, match=r"notes is not a shard folder \(it holds none of the files"):
        read_dataset_info(tmp_path / "digits" / "notes")


def test_validate_passes_an_intact_folder(tmp_path, capsys):
    root = make_shards(tmp_path / "ok")
    assert validate_cli.main([str(root), "--full"]) == 0
    assert "OK" in capsys.readouterr().out


def test_shards_without_one_decodable_image_fail_loudly_instead_of_spinning(tmp_path):
    root = make_shards(tmp_path / "bad", sizes=[4], member=lambda key, i, s: {**s, "jpg": b"garbage"})
    with pytest.raises(ShardFormatError, match="no usable sample"):
        next(iter(TrainStream(DataConfig.for_stream(root, micro_batch_size=2, image_size=16))))


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_shards_in_a_store_that_refuses_are_said_to_be_refused_not_absent(refusing_store, scheme):
    """fsspec's exists/isdir answer False for a store that refuses (wrong credentials on a cluster's workers), so a
    bucket's shard folder read as "does not exist; write one"; the store's own error now comes through."""
    from data_pipeline.manifest import is_shard_folder

    url = f"{scheme}://vitscale-denied/rcdb/train"
    with pytest.raises(OSError, match="Forbidden"):
        read_dataset_info(url)
    with pytest.raises(OSError, match="Forbidden"):
        is_shard_folder(url)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_validate_of_a_bucket_that_refuses_is_one_line_and_exit_2(refusing_store, scheme, capsys):
    """Wrong credentials for the bucket escaped `python -m data_pipeline.validate` as an OSError traceback."""
    url = f"{scheme}://vitscale-denied/rcdb/train"
    assert validate_cli.main([url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m data_pipeline.validate: error: {url}: ") and "Forbidden" in err
    assert "Traceback" not in err and err.count("\n") == 1


def _class_tar(path, images):
    with tarfile.open(path, "w") as tar:
        for i, data in enumerate(images):
            info = tarfile.TarInfo(f"{path.stem}_{i}.JPEG")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("processes", [1, 2])
def test_broken_source_tars_are_skipped_and_counted(tmp_path, processes):
    """A truncated, cut, corrupt or empty per-class tar costs only what cannot be read: the job goes on."""
    src = tmp_path / "i21k"
    src.mkdir()
    for c, name in enumerate(["n01", "n02", "n03"]):
        _class_tar(src / f"{name}.tar", [jpeg_bytes(10 * c + i) for i in range(4)])
    for name, cut_at in (("n02", "offset_data"), ("n03", "offset")):  # in the third image's data, in its header
        with tarfile.open(src / f"{name}.tar") as tar:
            cut = getattr(tar.getmembers()[2], cut_at) + 100
        (src / f"{name}.tar").write_bytes((src / f"{name}.tar").read_bytes()[:cut])
    (src / "n04.tar").write_bytes(b"")
    (src / "n05.tar").write_bytes(b"not a tar archive" * 40)
    report = writer.write_dataset(tmp_path / "out", writer.WriteConfig(processes=processes), source=open_source(src))
    assert report.skipped == {"broken_files": 4}
    sources = sorted(pq.read_table(tmp_path / "out" / "samples.parquet").column("source").to_pylist())
    kept = [f"n01:n01_{i}.JPEG" for i in range(4)] + [f"n0{c}:n0{c}_{i}.JPEG" for c in (2, 3) for i in (0, 1)]
    assert sources == kept  # the images before the damage are written


def test_bad_paths_and_sources_are_named_with_the_fix(tmp_path, capsys):
    (tmp_path / "afile").write_text("not a folder")
    assert validate_cli.main([str(tmp_path / "afile")]) == 2
    assert f"{tmp_path / 'afile'} is a file, not a shard folder" in capsys.readouterr().err
    assert write_cli.main(["--source", "s3://nobucket/foo", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--source s3://nobucket/foo: object storage is not a --source; copy it" in err and "\n" not in err.strip()


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (["cat", "dog"], r"column 'y' holds string labels \(e.g. 'cat'\), not class ids; give integer class ids"),
        ([0.0, 1.5], r"column 'y' holds label 1.5, not a whole number"),
    ],
)
def test_parquet_labels_that_are_not_class_ids_are_refused(tmp_path, labels, message):
    import pyarrow as pa

    pq.write_table(pa.table({"image": [jpeg_bytes(0), jpeg_bytes(1)], "y": labels}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'd.parquet'}: {message}"):
        open_source(tmp_path / "d.parquet", label_column="y")
