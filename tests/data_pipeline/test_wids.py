"""Shard folders carry indexes other readers use: webdataset's ``wids`` reads every sample through
``shardindex.json`` with the labels and bytes ``samples.parquet`` states, from wherever the folder is moved;
timm's ``_info.json`` agrees with the manifest; `data_pipeline.validate` checks both."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import wids
from PIL import Image

from data_pipeline import manifest
from data_pipeline import validate as validate_cli
from data_pipeline.manifest import TIMM_INFO_FILE, WIDS_INDEX_FILE, read_dataset_info
from data_pipeline.paths import PROJECT_ROOT
from data_pipeline.write.writer import WriteConfig, write_dataset


def jpeg(seed: int) -> bytes:
    small = np.random.default_rng(seed).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(small).resize((20, 16), Image.BICUBIC).save(out, format="JPEG", quality=90)
    return out.getvalue()


@pytest.fixture()
def folder(tmp_path) -> Path:
    """3 classes x 7 images in shards of 5: 5 shards, the last holding 1 sample."""
    items = [(jpeg(k), k % 3, f"item{k}") for k in range(21)]
    out = tmp_path / "set" / "train"
    config = WriteConfig(name="set", split="train", samples_per_shard=5, processes=1, max_short_side=64)
    write_dataset(out, config, items=items, class_names=["a", "b", "c"])
    return out


def samples_by_key(folder: Path) -> dict[str, dict]:
    return {row["key"]: row for row in pq.read_table(folder / "samples.parquet").to_pylist()}


def read_all_with_wids(index: Path, cache: Path) -> dict[str, tuple[int, str, str]]:
    """key -> (label, sha256 of the image bytes, shard file name) of every sample wids gives, in its order."""
    dataset = wids.ShardListDataset(str(index), cache_dir=str(cache), transformations=[])
    seen = {}
    for i in range(len(dataset)):
        sample = dataset[i]
        label = int(sample[".cls"].read())
        digest = hashlib.sha256(sample[".jpg"].read()).hexdigest()
        seen[sample["__key__"]] = (label, digest, Path(sample["__shard__"]).name)
    dataset.close()
    return seen


def test_wids_reads_every_sample_with_the_labels_samples_parquet_states(folder, tmp_path):
    index = json.loads((folder / WIDS_INDEX_FILE).read_text())
    assert index["__kind__"] == "wids-shard-index-v1" and index["wids_version"] == 1 and index["name"] == "set-train"
    assert [s["url"] for s in index["shardlist"]] == [f"shard-{i:06d}.tar" for i in range(5)]  # relative
    assert [s["nsamples"] for s in index["shardlist"]] == [5, 5, 5, 5, 1]
    assert [s["filesize"] for s in index["shardlist"]] == [r.bytes for r in read_dataset_info(folder).shards]

    expected = {k: (r["label"], r["sha256"], r["shard"]) for k, r in samples_by_key(folder).items()}
    assert read_all_with_wids(folder / WIDS_INDEX_FILE, tmp_path / "cache") == expected

    moved = tmp_path / "elsewhere" / "copy"  # relative URLs: the folder reads the same after a move
    shutil.copytree(folder, moved)
    shutil.rmtree(folder)
    assert read_all_with_wids(moved / WIDS_INDEX_FILE, tmp_path / "cache2") == expected


def test_timm_info_lists_the_manifest_shards(folder):
    info = json.loads((folder / TIMM_INFO_FILE).read_text())
    split = info["splits"]["train"]
    assert info["name"] == "set" and info["num_classes"] == 3
    assert split["name"] == "train" and split["num_samples"] == 21
    assert split["shard_lengths"] == [5, 5, 5, 5, 1]
    for name, length in zip(split["filenames"], split["shard_lengths"]):  # relative to the folder, as timm joins
        with tarfile.open(folder / name) as tar:
            assert sum(m.name.endswith(".cls") for m in tar) == length


def test_validate_checks_the_indexes(folder, capsys):
    assert validate_cli.main([str(folder)]) == 0
    assert "note:" not in capsys.readouterr().out
    originals = {n: (folder / n).read_bytes() for n in (WIDS_INDEX_FILE, TIMM_INFO_FILE)}

    for name in originals:  # a folder written before the indexes: intact, with a note naming the fix
        (folder / name).unlink()
    assert validate_cli.main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.count("note: no ") == 2 and "--write-index" in out and "OK:" in out

    assert validate_cli.main([str(folder), "--write-index"]) == 0
    assert "note:" not in capsys.readouterr().out
    assert {n: (folder / n).read_bytes() for n in originals} == originals  # the writer's own bytes
    (folder / WIDS_INDEX_FILE).unlink()  # a file:// URL is a local folder too
    assert validate_cli.main([folder.as_uri(), "--write-index"]) == 0
    assert (folder / WIDS_INDEX_FILE).read_bytes() == originals[WIDS_INDEX_FILE]
    capsys.readouterr()

    index = json.loads(originals[WIDS_INDEX_FILE])
    index["shardlist"][2]["nsamples"] = 4
    (folder / WIDS_INDEX_FILE).write_text(json.dumps(index))
    assert validate_cli.main([str(folder)]) == 1
    assert "shardindex.json: shard shard-000002.tar has 4 samples there, 5 in the manifest" in capsys.readouterr().out

    index["shardlist"][2]["nsamples"] = 5
    index["shardlist"][0]["url"] = str(folder / "shard-000000.tar")
    (folder / WIDS_INDEX_FILE).write_text(json.dumps(index))
    assert validate_cli.main([str(folder)]) == 1
    assert "absolute shard URLs" in capsys.readouterr().out

    (folder / WIDS_INDEX_FILE).write_bytes(originals[WIDS_INDEX_FILE])
    info = json.loads(originals[TIMM_INFO_FILE])
    info["splits"]["train"]["filenames"].pop()
    (folder / TIMM_INFO_FILE).write_text(json.dumps(info))
    (folder / WIDS_INDEX_FILE).write_text("{not json")
    report = validate_cli.validate(str(folder))
    assert not report.ok and len(report.problems) == 2
    assert any("shardindex.json does not parse" in p for p in report.problems)
    assert any(p.startswith("_info.json lists the shards") for p in report.problems)


def test_write_index_takes_a_relative_folder_from_the_current_directory(folder, tmp_path, monkeypatch, capsys):
    """--write-index took a relative folder from the project root, the check after it from the current directory:
    the command validate recommends failed, or wrote into a same-named folder under the project root."""
    originals = {n: (folder / n).read_bytes() for n in (WIDS_INDEX_FILE, TIMM_INFO_FILE)}
    for name in originals:
        (folder / name).unlink()
    monkeypatch.chdir(tmp_path)
    assert validate_cli.main(["set/train", "--write-index"]) == 0
    assert "note:" not in capsys.readouterr().out
    assert {n: (folder / n).read_bytes() for n in originals} == originals
    assert not (PROJECT_ROOT / "set" / "train").exists()


def test_write_metadata_callers_without_names_get_folder_names(tmp_path):
    """Folders written by other code (benchmarks, tests) with bare metadata still get consistent indexes."""
    root = tmp_path / "bare" / "val"
    root.mkdir(parents=True)
    rows = [dict(url="shard-000000.tar", samples=3, bytes=10, sha256="0" * 64)]
    manifest.write_metadata(root, shards=rows, samples=None, class_names=["x"], dataset={})
    assert json.loads((root / WIDS_INDEX_FILE).read_text())["name"] == "bare-val"
    assert list(json.loads((root / TIMM_INFO_FILE).read_text())["splits"]) == ["val"]


@pytest.mark.parametrize("url", ["/etc/passwd", "OUTSIDE", "../other/shard-000000.tar", "a/../../x.tar", "s3://b/x"])
def test_a_manifest_naming_a_shard_outside_its_folder_is_refused(folder, url, capsys):
    """The manifest's shard URLs were joined to the folder unchecked: an absolute path or one through '..' made
    validate (and the streams) read files outside the folder. Such a manifest is now refused with one line."""
    other = folder.parent / "other"
    other.mkdir()
    shutil.copy(folder / "shard-000000.tar", other / "shard-000000.tar")
    url = str(other / "shard-000000.tar") if url == "OUTSIDE" else url
    table = pq.read_table(folder / manifest.MANIFEST_FILE)
    rows = table.to_pylist()
    rows[0]["url"] = url
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), folder / manifest.MANIFEST_FILE)
    with pytest.raises(manifest.ShardFormatError, match="not a path inside the folder") as raised:
        read_dataset_info(folder)
    assert repr(url) in str(raised.value) and "\n" not in str(raised.value)
    assert validate_cli.main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged" not in err and repr(url) in err
