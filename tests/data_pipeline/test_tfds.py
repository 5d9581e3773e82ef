"""TFDS folders → shards without TensorFlow: CRC-32C, TFRecord framing, tf.train.Example, split syntax, VTAB-1k's
splits and derived labels, and the errors of `python -m data_pipeline.write --source tfds:DIR`.

Every TFDS folder here is written by the test itself in TFDS's layout (dataset_info.json, features.json,
``<name>-<split>.tfrecord-NNNNN-of-MMMMM``), its records encoded with data_pipeline.write.tfrecord's own encoder."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from data_pipeline.validate import validate
from data_pipeline.write import __main__ as write_cli
from data_pipeline.write.tfds import resolve_split
from data_pipeline.write.tfrecord import (
    _crc_loop,
    crc32c,
    decode_example,
    encode_example,
    masked_crc32c,
    scan_records,
    write_records,
)
from data_pipeline.write.vtab_tfds import LABEL_FUNCTIONS, TASKS, split_expression
from evals.vtab import VTAB1K_TASKS

IMAGE = {
    "pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
    "image": {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "uint8", "encodingFormat": "jpeg"},
}


def class_label(n: int) -> dict:
    return {
        "pythonClassName": "tensorflow_datasets.core.features.class_label_feature.ClassLabel",
        "classLabel": {"numClasses": str(n)},
    }


def tensor(shape: list[int], dtype: str) -> dict:
    spec = {"shape": {"dimensions": [str(d) for d in shape]}, "dtype": dtype, "encoding": "none"}
    return {"pythonClassName": "tensorflow_datasets.core.features.tensor_feature.Tensor", "tensor": spec}


def features_dict(features: dict) -> dict:
    return {
        "pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
        "featuresDict": {"features": features},
    }


def jpeg(seed: int, size=(24, 20)) -> bytes:
    small = np.random.default_rng(seed).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(small).resize(size, Image.BICUBIC).save(out, format="JPEG", quality=90)
    return out.getvalue()


def make_tfds(folder: Path, name: str, splits: dict[str, list[list[dict]]], features: dict) -> Path:
    """A TFDS version folder: ``splits`` maps a split to its files, each a list of Example feature dicts."""
    folder.mkdir(parents=True)
    info = {
        "name": name,
        "version": "1.0.0",
        "fileFormat": "tfrecord",
        "splits": [],
        "supervisedKeys": {"tuple": {"items": [{"featureKey": "image"}, {"featureKey": "label"}]}},
    }
    for split, files in splits.items():
        for i, records in enumerate(files):
            path = folder / f"{name}-{split}.tfrecord-{i:05d}-of-{len(files):05d}"
            write_records(path, [encode_example(r) for r in records])
        info["splits"].append(
            {
                "name": split,
                "shardLengths": [str(len(r)) for r in files],
                "numBytes": "0",
                "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
            }
        )
    (folder / "dataset_info.json").write_text(json.dumps(info))
    (folder / "features.json").write_text(json.dumps(features_dict(features)))
    return folder


@pytest.fixture()
def toy(tmp_path) -> tuple[Path, dict[str, list[dict]]]:
    """A classification folder: train = 2 files (7 + 6 records), test = 1 file (5), JPEG images, 3 named classes."""
    records: dict[str, list[dict]] = {"train": [], "test": []}
    for k in range(18):
        records["train" if k < 13 else "test"].append({"image": [jpeg(k)], "label": [k % 3], "id": [f"x{k}".encode()]})
    splits = {"train": [records["train"][:7], records["train"][7:]], "test": [records["test"]]}
    folder = make_tfds(tmp_path / "toy" / "1.0.0", "toy", splits, {"image": IMAGE, "label": class_label(3)})
    (folder / "label.labels.txt").write_text("cat\ndog\nbird\n")
    return folder, records


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = write_cli.main([*argv, "--processes", "1"])
    out, err = capsys.readouterr()
    return code, out, err


def test_crc32c_known_value_and_the_vectorized_path_agree_with_the_loop():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    rng = np.random.default_rng(0)
    for n in (1, 3, 4, 5, 1023, 1024, 1025, 4097, 65_536, 100_003, (1 << 20) + 7):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert crc32c(data) == _crc_loop(data, 0xFFFFFFFF) ^ 0xFFFFFFFF, n
    crc = crc32c(b"abc")
    assert masked_crc32c(b"abc") == ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def test_example_round_trip_and_unpacked_encodings():
    example = {
        "image": [b"\x00\xffjpeg"],
        "label": [7],
        "ints": [-5, 0, 2**40],
        "floats": [1.5, -2.25],
        "s": [b"a", b""],
    }
    assert decode_example(encode_example(example)) == example

    def field(number: int, payload: bytes) -> bytes:  # a length-delimited field with a one-byte length
        return bytes([number << 3 | 2, len(payload)]) + payload

    # Int64List and FloatList written unpacked (one tagged value each), as old writers may: the same values.
    int64_list = field(3, b"\x08\x05" + b"\x08" + b"\xfe" + b"\xff" * 8 + b"\x01")  # 5 and -2 (ten-byte varint)
    float_list = field(2, b"\x0d" + struct.pack("<f", 0.5) + b"\x0d" + struct.pack("<f", -1.0))
    entries = field(1, field(1, b"n") + field(2, int64_list)) + field(1, field(1, b"f") + field(2, float_list))
    assert decode_example(field(1, entries)) == {"n": [5, -2], "f": [0.5, -1.0]}


def test_scan_records_skips_a_bad_crc_and_counts_a_cut_file(tmp_path):
    path = tmp_path / "x.tfrecord"
    write_records(path, [b"zero", b"one!", b"two..", b"three"])
    data = bytearray(path.read_bytes())
    data[12 + 4 + 4 + 12 + 1] ^= 0xFF  # a byte of record 1's data: its data CRC fails
    path.write_bytes(bytes(data[:-3]))  # and record 3 is cut short
    stats: Counter = Counter()
    with open(path, "rb") as f:
        got = [(i, d) for i, _, d in scan_records(f, 0, 4, stats)]
    assert got == [(0, b"zero"), (2, b"two..")]
    assert stats == {"corrupt_records": 1, "broken_files": 1, "missing_records": 1}


def test_resolve_split_follows_tfds_slicing():
    sizes = {"train": 13, "test": 5}
    assert resolve_split("train", sizes) == [("train", 0, 13)]
    assert resolve_split("train[2:9]+test[:40%]", sizes) == [("train", 2, 9), ("test", 0, 2)]
    assert resolve_split("train[-3:]+test[50%:]", sizes) == [("train", 10, 13), ("test", 2, 5)]  # round(2.5) = 2
    with pytest.raises(ValueError, match="not in this TFDS folder"):
        resolve_split("validation", sizes)
    with pytest.raises(ValueError, match="TFDS split syntax"):
        resolve_split("train[::2]", sizes)


def test_tfds_folder_to_shards_round_trips_labels_and_bytes_and_counts_a_corrupt_record(toy, tmp_path, capsys):
    folder, records = toy
    file = folder / "toy-train.tfrecord-00001-of-00002"  # train[7..12]; corrupt its record 3 = train[10]
    data = bytearray(file.read_bytes())
    offset = 0
    for _ in range(3):
        offset += 12 + struct.unpack("<Q", data[offset : offset + 8])[0] + 4
    data[offset + 12 + 30] ^= 0x55
    file.write_bytes(bytes(data))

    out = tmp_path / "shards" / "train"
    code, stdout, err = run(["--source", f"tfds:{folder}", "--out", str(out), "--samples-per-shard", "4"], capsys)
    assert code == 0, err
    assert "'corrupt_records': 1" in stdout and "wrote 12 in 3 shards" in stdout
    rows = pq.read_table(out / "samples.parquet").to_pylist()
    assert sorted(r["source"] for r in rows) == sorted(f"train[{i}]" for i in range(13) if i != 10)
    for row in rows:
        original = records["train"][int(row["source"][6:-1])]
        assert row["label"] == original["label"][0]
        assert row["sha256"] == row["source_sha256"] == hashlib.sha256(original["image"][0]).hexdigest()  # as is
    names = pq.read_table(out / "classes.parquet").column("name").to_pylist()
    assert names == ["cat", "dog", "bird"]
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["name"] == "toy" and meta["tfds"]["split"] == "train" and meta["num_samples"] == 12
    assert validate(str(out), full=True).ok

    sub = tmp_path / "shards" / "sub"
    code, _, err = run(
        ["--source", f"tfds:{folder}", "--out", str(sub), "--tfds-split", "train[2:9]+test[:40%]", "--split", "mixed"],
        capsys,
    )
    assert code == 0, err
    sources = sorted(pq.read_table(sub / "samples.parquet").column("source").to_pylist())
    assert sources == sorted([f"train[{i}]" for i in range(2, 9)] + ["test[0]", "test[1]"])


def test_vtab_split_definitions():
    cifar = {"train": 50_000, "test": 10_000}
    assert split_expression(TASKS["cifar100"], "train", cifar) == "train[:800]+train[45000:45200]"
    assert split_expression(TASKS["cifar100"], "test", cifar) == "test"
    assert split_expression(TASKS["cifar100"], "val", cifar) == "train[45000:]"
    three = {"train": 100, "validation": 10, "test": 20}
    assert split_expression(TASKS["dtd"], "train", three) == "train[:800]+validation[:200]"
    assert split_expression(TASKS["pets"], "val200", {"train": 3680, "test": 3669}) == "train[2944:3144]"
    eurosat = {"train": 27_000}
    assert split_expression(TASKS["eurosat"], "train", eurosat) == "train[:800]+train[16200:16400]"
    assert split_expression(TASKS["eurosat"], "test", eurosat) == "train[21600:]"
    dsprites = {"train": 737_280}
    assert split_expression(TASKS["dsprites_loc"], "val200", dsprites) == "train[589824:590024]"
    assert split_expression(TASKS["dsprites_ori"], "test", dsprites) == "train[663552:]"
    norb = {"train": 24_300, "test": 24_300}
    assert split_expression(TASKS["smallnorb_azim"], "train", norb) == "train[:800]+test[:200]"
    assert split_expression(TASKS["smallnorb_elev"], "test", norb) == "test[50%:]"
    assert split_expression(TASKS["clevr_count"], "test", {"train": 70_000, "validation": 15_000}) == "validation"
    with pytest.raises(ValueError, match="needs the TFDS split 'validation'"):
        split_expression(TASKS["dtd"], "train", {"train": 10, "test": 10})
    # The same 19 tasks, names and class counts as the VTAB evaluator's table.
    assert {n: t.num_classes for n, t in TASKS.items()} == {n: t.num_classes for n, t in VTAB1K_TASKS.items()}


def test_vtab_label_functions():
    kitti = {"objects/type": [3, 0, 1], "objects/location": [0, 0, 5.0, 1, 1, 12.0, 2, 2, 30.0]}
    assert LABEL_FUNCTIONS["kitti_dist"](kitti) == 1  # the pedestrian at 5 m is not a vehicle: closest 12 m
    assert LABEL_FUNCTIONS["kitti_dist"]({"objects/type": [4], "objects/location": [0, 0, 3.0]}) == 3  # none
    assert LABEL_FUNCTIONS["clevr_dist"]({"objects/pixel_coords": [10, 20, 9.2, 30, 40, 11.0]}) == 3
    assert LABEL_FUNCTIONS["clevr_count"]({"objects/size": [0, 1, 0, 1]}) == 1
    assert [LABEL_FUNCTIONS["dsprites_ori"]({"label_orientation": [v]}) for v in (0, 2, 3, 39)] == [0, 0, 1, 15]
    assert [LABEL_FUNCTIONS["dsprites_loc"]({"label_x_position": [v]}) for v in (0, 1, 2, 31)] == [0, 0, 1, 15]
    assert LABEL_FUNCTIONS["label_elevation"]({"label_elevation": [8]}) == 8


def test_vtab_derived_labels_end_to_end(tmp_path, capsys):
    rng = np.random.default_rng(1)
    records = []
    for k in range(30):
        n = int(rng.integers(3, 11))
        coords = [float(v) for obj in range(n) for v in (10.0 * obj, 5.0, float(rng.uniform(7.0, 11.0)))]
        records.append(
            {"image": [jpeg(100 + k)], "objects/size": [obj % 2 for obj in range(n)], "objects/pixel_coords": coords}
        )
    objects = {
        "pythonClassName": "tensorflow_datasets.core.features.sequence_feature.Sequence",
        "sequence": {
            "feature": features_dict({"size": class_label(2), "pixel_coords": tensor([3], "float32")}),
            "length": "-1",
        },
    }
    folder = make_tfds(
        tmp_path / "clevr" / "3.1.0",
        "clevr",
        {"train": [records[:20]], "validation": [records[20:]]},
        {"image": IMAGE, "objects": objects},
    )

    out = tmp_path / "vtab" / "clevr_count" / "train"
    code, stdout, err = run(["--source", f"tfds:{folder}", "--vtab", "clevr_count", "--out", str(out)], capsys)
    assert code == 0, err
    rows = pq.read_table(out / "samples.parquet").to_pylist()
    # train800val200 = train[:800] + train[18:218] of 20 records: all 20, then records 18 and 19 again (kept)
    assert Counter(r["source"] for r in rows) == Counter(
        [f"train[{i}]" for i in range(20)] + ["train[18]", "train[19]"]
    )
    for row in rows:
        assert row["label"] == len(records[int(row["source"][6:-1])]["objects/size"]) - 3
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["name"] == "clevr_count" and meta["num_classes"] == 8 and meta["tfds"]["vtab_task"] == "clevr_count"

    out = tmp_path / "vtab" / "clevr_dist" / "test"
    code, _, err = run(
        ["--source", f"tfds:{folder}", "--vtab", "clevr_dist", "--split", "test", "--out", str(out)], capsys
    )
    assert code == 0, err
    for row in pq.read_table(out / "samples.parquet").to_pylist():
        assert row["source"].startswith("validation[")
        depth = min(records[20 + int(row["source"][11:-1])]["objects/pixel_coords"][2::3])
        assert row["label"] == max(i for i, t in enumerate((0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0)) if t < depth)


def test_vtab_dsprites_scales_binary_pixels(tmp_path, capsys):
    def binary_png(seed: int) -> bytes:
        pixels = (np.random.default_rng(seed).random((16, 16)) > 0.5).astype(np.uint8)  # 0/1, as dSprites stores
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        return out.getvalue()

    records = [{"image": [binary_png(k)], "label_orientation": [2 * k]} for k in range(20)]
    gray = {**IMAGE, "image": {**IMAGE["image"], "shape": {"dimensions": ["64", "64", "1"]}, "encodingFormat": "png"}}
    folder = make_tfds(
        tmp_path / "dsprites" / "2.0.0",
        "dsprites",
        {"train": [records]},
        {"image": gray, "label_orientation": class_label(40)},
    )
    out = tmp_path / "dsprites_ori" / "test"
    code, _, err = run(
        ["--source", f"tfds:{folder}", "--vtab", "dsprites_ori", "--split", "test", "--out", str(out)], capsys
    )
    assert code == 0, err
    rows = pq.read_table(out / "samples.parquet").to_pylist()
    assert sorted(r["source"] for r in rows) == ["train[18]", "train[19]"]  # train[80%+10%:] of 20
    assert sorted(r["label"] for r in rows) == [int(36 // 2.5), int(38 // 2.5)]
    with tarfile.open(out / "shard-000000.tar") as tar:
        images = [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")]  # type: ignore[union-attr]
    assert len(images) == 2
    for image in images:
        assert np.asarray(Image.open(io.BytesIO(image))).max() > 200  # 0/1 became 0/255


@pytest.mark.parametrize(
    "case, expected",
    [
        ("not_a_folder", "is not a TFDS dataset folder (it is not a folder)"),
        ("no_info", "is not a TFDS dataset folder (no dataset_info.json)"),
        ("no_features", "is not a TFDS dataset folder (no features.json)"),
        ("image_is_a_label", "image feature 'label' is a ClassLabel"),
        ("wrong_vtab_dataset", "VTAB task cifar100 reads the TFDS dataset cifar100, but"),
        ("unknown_vtab_task", "--vtab 'cifar1000' is not a VTAB-1k task"),
        ("unknown_split", "--split 'val' is not a split of"),
        ("vtab_without_tfds", "--vtab and --tfds-split select records of a TFDS folder"),
    ],
)
def test_bad_tfds_input_exits_2_with_one_message(toy, tmp_path, capsys, case, expected):
    folder, _ = toy
    source = f"tfds:{folder}"
    extra: list[str] = []
    if case == "not_a_folder":
        source = f"tfds:{tmp_path / 'nowhere'}"
    elif case == "no_info":
        (folder / "dataset_info.json").unlink()
    elif case == "no_features":
        (folder / "features.json").unlink()
    elif case == "image_is_a_label":
        extra = ["--image-column", "label"]
    elif case == "wrong_vtab_dataset":
        extra = ["--vtab", "cifar100"]
    elif case == "unknown_vtab_task":
        extra = ["--vtab", "cifar1000"]
    elif case == "unknown_split":
        extra = ["--split", "val"]
    else:
        source, extra = str(folder), ["--vtab", "cifar100", "--kind", "folder"]
    out = tmp_path / "out"
    code, _, err = run(["--source", source, "--out", str(out), *extra], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err
    assert not out.exists()  # refused before any folder was made


def test_older_tfds_metadata_is_read(toy, tmp_path, capsys):
    """features.json in the older ``type``/``content`` form and a dataset_info.json without per-file counts."""
    folder, records = toy
    old = {
        "type": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
        "content": {
            "image": {
                "type": "tensorflow_datasets.core.features.image_feature.Image",
                "content": {"shape": [None, None, 3], "dtype": "uint8", "encoding_format": "jpeg"},
            },
            "label": {
                "type": "tensorflow_datasets.core.features.class_label_feature.ClassLabel",
                "content": {"num_classes": 3},
            },
        },
    }
    (folder / "features.json").write_text(json.dumps(old))
    info = json.loads((folder / "dataset_info.json").read_text())
    for split in info["splits"]:
        del split["shardLengths"]
    info["supervisedKeys"] = {"input": "image", "output": "label"}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    out = tmp_path / "old" / "test"
    code, _, err = run(["--source", f"tfds:{folder}", "--split", "test[1:]", "--out", str(out)], capsys)
    assert code == 2 and "--split 'test[1:]' is not a split" in err  # --split names a split; slices: --tfds-split
    code, _, err = run(["--source", f"tfds:{folder}", "--tfds-split", "test[1:]", "--out", str(out)], capsys)
    assert code == 0, err
    rows = pq.read_table(out / "samples.parquet").to_pylist()
    assert sorted(r["source"] for r in rows) == ["test[1]", "test[2]", "test[3]", "test[4]"]
    assert all(r["label"] == records["test"][int(r["source"][5:-1])]["label"][0] for r in rows)


def test_class_names_given_for_a_tfds_folder_are_read_as_for_other_sources_and_must_fit(toy, tmp_path, capsys):
    """A --class-names file of another count was ignored (the names "0", "1", ... written), and 'label name' lines
    became the names "0 Katze", ...; the folder's own label.labels.txt still gives way quietly where it does not fit."""
    folder, _ = toy
    names = tmp_path / "names.txt"
    argv = ["--source", f"tfds:{folder}", "--split", "test", "--class-names", str(names)]
    for lines, count in (
        ("Katze\nHund\n", 2),
        ("0 Katze\n1 Hund\n2 Vogel\n3 Aal\n", 4),
        ("1 Hund\n2 Vogel\n3 Aal\n", 4),
    ):
        names.write_text(lines)
        code, _, err = run([*argv, "--out", str(tmp_path / "refused")], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"--class-names {names} names {count} classes but 'label' in {folder} has 3; give 3 names" in err
    for i, lines in enumerate(("0 Katze\n1 Hund\n2 Vogel\n", "2\tVogel\n0\tKatze\n1\tHund\n", "Katze\nHund\nVogel\n")):
        names.write_text(lines)
        out = tmp_path / f"out{i}"
        code, _, err = run([*argv, "--out", str(out)], capsys)
        assert code == 0, err
        assert pq.read_table(out / "classes.parquet").column("name").to_pylist() == ["Katze", "Hund", "Vogel"]
    (folder / "label.labels.txt").write_text("cat\ndog\n")
    code, _, err = run(["--source", f"tfds:{folder}", "--split", "test", "--out", str(tmp_path / "own")], capsys)
    assert code == 0, err
    assert pq.read_table(tmp_path / "own" / "classes.parquet").column("name").to_pylist() == ["0", "1", "2"]


def test_a_tfds_folder_needs_the_files_of_the_splits_it_is_read_for_only(toy, tmp_path, capsys):
    """A copy holding only the test split's files was refused for --split test: "no toy-train.tfrecord-* files"."""
    folder, _ = toy
    for file in folder.glob("toy-train.tfrecord-*"):
        file.unlink()
    code, stdout, err = run(["--source", f"tfds:{folder}", "--split", "test", "--out", str(tmp_path / "test")], capsys)
    assert code == 0, err
    assert "wrote 5 in" in stdout
    for split in (["--split", "train"], ["--tfds-split", "test+train[:2]"]):
        code, _, err = run(["--source", f"tfds:{folder}", *split, "--out", str(tmp_path / "train")], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert "is not a TFDS dataset folder (no toy-train.tfrecord-* files for split 'train')" in err
    assert not (tmp_path / "train").exists()
