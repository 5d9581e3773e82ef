"""Formula-driven pre-training sets (rcdb, fractal): same bytes per seed, sizes, parallel = serial, bad sizes fail."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from data_pipeline.builtin import __main__ as builtin_cli
from data_pipeline.builtin import formula
from data_pipeline.builtin import sets as builtin
from data_pipeline.manifest import read_dataset_info
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.validate import validate

TINY = dict(num_classes=6, images_per_class=4, val_per_class=2, resolution=32, samples_per_shard=8)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["rcdb", "fractal"])
def test_formula_set_is_deterministic_sized_and_valid(tmp_path, kind):
    a = builtin.ensure(kind, tmp_path / "a", **TINY)
    b = builtin.ensure(kind, tmp_path / "b", **TINY)
    c = builtin.ensure(kind, tmp_path / "c", **{**TINY, "seed": 1})
    train, val = read_dataset_info(a / "train"), read_dataset_info(a / "val")
    assert (train.num_classes, train.num_samples, val.num_samples) == (6, 24, 12)
    shards = sorted(p.name for p in (a / "train").glob("shard-*.tar"))
    assert len(shards) == 3
    for shard in shards:
        assert (a / "train" / shard).read_bytes() == (b / "train" / shard).read_bytes()
    assert (a / "train" / shards[0]).read_bytes() != (c / "train" / shards[0]).read_bytes()
    x, y = next(iter(EvalStream(a / "train", batch_size=24, image_size=32)))
    assert x.shape == (24, 3, 32, 32) and sorted(set(y.tolist())) == list(range(6))
    assert not (x[y == 0][0] == x[y == 0][1]).all()  # instances of one class differ
    assert validate(str(a / "train"), full=True).ok and validate(str(a / "val"), full=True).ok


@pytest.mark.timeout(120)
def test_classes_are_independent_and_workers_do_not_change_bytes():
    serial = formula.generate("rcdb", 0, "train", 10, 2, 32, workers=1)
    parallel = formula.generate("rcdb", 0, "train", 10, 2, 32, workers=2)
    assert serial == parallel
    alone = formula._generate_classes(("rcdb", 0, "train", [7], 2, 32, {}))  # class 7 without classes 0-6
    assert alone == [item for item in serial if item[1] == 7]
    assert (
        formula._generate_classes(("fractal", 0, "val", [3], 1, 32, {}))
        == formula.generate("fractal", 0, "val", 4, 1, 32)[3:]
    )


def _centroids(items, num_classes: int) -> np.ndarray:
    """(num_classes, 2) mean intensity centroid (x, y) of each class's images, in pixels."""
    sums = np.zeros((num_classes, 2))
    for data, label, _ in items:
        pixels = np.asarray(Image.open(io.BytesIO(data)).convert("L"), dtype=np.float64)
        pixels -= np.median(pixels)  # the background level
        pixels = np.clip(pixels, 0, None)
        ys, xs = np.indices(pixels.shape)
        sums[label] += (xs * pixels).sum() / pixels.sum(), (ys * pixels).sum() / pixels.sum()
    return sums / (len(items) / num_classes)


def test_rcdb_class_offset_gives_each_class_its_own_place():
    centred = formula.generate("rcdb", 0, "train", 12, 4, 32)
    placed = formula.generate("rcdb", 0, "train", 12, 4, 32, class_offset=0.3)
    assert centred == formula.generate("rcdb", 0, "train", 12, 4, 32, class_offset=0.0)  # 0: the centred set's bytes
    spread_centred = _centroids(centred, 12).std(axis=0)
    spread_placed = _centroids(placed, 12).std(axis=0)
    # centred classes differ by the instance jitter only; placed ones by up to 0.3 half sides (4.8 px at 32 px)
    assert (spread_centred < 1.2).all() and (spread_placed > 1.8).all(), (spread_centred, spread_placed)
    with pytest.raises(ValueError, match="class_offset=0.3 applies to rcdb only"):
        formula.generate("fractal", 0, "train", 2, 1, 32, class_offset=0.3)


def test_class_offset_is_a_setting_of_the_folder(tmp_path):
    folder = builtin.ensure("rcdb", tmp_path, **TINY, class_offset=0)  # centred, as every rcdb before the setting
    meta = folder / "train" / "dataset.json"
    stored = json.loads(meta.read_text())
    stored["builtin"].pop("class_offset")  # as written before the setting existed
    meta.write_text(json.dumps(stored))
    assert builtin.ensure("rcdb", tmp_path, **TINY, class_offset=0) == folder  # reused: it was made at 0
    # rcdb's default is 30 now (local_demo's): an old folder counts at the 0 it was made with, not at today's default
    assert builtin.config("rcdb").class_offset == 30
    with pytest.raises(
        ValueError, match=r"rcdb/train was generated with class_offset=0 \(wanted 30\); delete it \(rm -r "
    ):
        builtin.ensure("rcdb", tmp_path, **TINY)
    with pytest.raises(ValueError, match="class_offset=51 is out of range; use 0..50"):
        builtin.ensure("rcdb", tmp_path / "new", **TINY, class_offset=51)
    assert not (tmp_path / "new").exists()


def test_rcdb_ramp_background_replaces_only_the_background():
    spec, ramped_spec = formula.rcdb_class(0, 3, 0.3), formula.rcdb_class(0, 3, 0.3, ramp=160)
    plain = np.asarray(formula.rcdb_image(spec, np.random.default_rng([0, 1, 3, 0]), 32))
    ramped = np.asarray(formula.rcdb_image(ramped_spec, np.random.default_rng([0, 1, 3, 0]), 32))
    foreground = plain.max(-1) > formula.RAMP_THRESHOLD
    assert 0.02 < foreground.mean() < 0.6  # a contour, and background around it
    assert np.array_equal(ramped[foreground], plain[foreground])  # the contour's pixels are untouched
    background = ramped[~foreground].astype(float)  # (P, 3): a ramp, not the dark grey
    assert background.max() < 160 and background.std(axis=0).max() > 5 and background.mean() > 40
    # Smooth: neighbouring background pixels differ by a small step of the ramp (≤ 160 / 31 per channel, rounding).
    both = ~foreground[:, 1:] & ~foreground[:, :-1]
    steps = np.abs(np.diff(ramped.astype(int), axis=1))[both]
    assert steps.max() <= 7, steps.max()
    # Deterministic per image, whatever the process split; 0 leaves the dark sets' bytes as they were.
    assert formula.generate("rcdb", 0, "train", 6, 3, 32, 1, 0.3, 160) == formula.generate(
        "rcdb", 0, "train", 6, 3, 32, 2, 0.3, 160
    )
    dark = formula.generate("rcdb", 0, "val", 4, 2, 32)
    assert formula.generate("rcdb", 0, "val", 4, 2, 32, background_ramp=0) == dark
    with pytest.raises(ValueError, match="background_ramp=160 applies to rcdb only"):
        formula.generate("fractal", 0, "train", 2, 1, 32, background_ramp=160)


def test_background_ramp_is_a_setting_of_the_folder(tmp_path):
    folder = builtin.ensure("rcdb", tmp_path, **TINY, background_ramp=0)  # dark, as every rcdb before the setting
    meta = folder / "train" / "dataset.json"
    stored = json.loads(meta.read_text())
    assert stored["builtin"]["background_ramp"] == 0
    stored["builtin"].pop("background_ramp")  # as written before the setting existed
    meta.write_text(json.dumps(stored))
    assert builtin.ensure("rcdb", tmp_path, **TINY, background_ramp=0) == folder
    assert builtin.config("rcdb").background_ramp == 160  # rcdb's default now (local_demo's)
    with pytest.raises(ValueError, match=r"generated with background_ramp=0 \(wanted 160\); delete it"):
        builtin.ensure("rcdb", tmp_path, **TINY)
    with pytest.raises(ValueError, match="background_ramp=257 is out of range; use 0 .dark background. or 1..256"):
        builtin.ensure("rcdb", tmp_path / "new", **TINY, background_ramp=257)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--set", "num_classes=0"], "num_classes must be an integer >= 1"),
        (["--set", "num_classes=21844"], "num_classes=21844 is out of range; use 1..21843"),
        (["--set", "resolution=8"], "resolution=8 is out of range"),
        (["--set", "resolution=256"], "resolution=256 is out of range"),
        (["--set", "images_per_class=0"], "images_per_class must be an integer >= 1"),
        (["--workers", "0"], "--workers 0"),
    ],
)
@pytest.mark.parametrize("kind", ["rcdb", "fractal"])
def test_impossible_sizes_fail_before_writing(tmp_path, capsys, kind, argv, message):
    out = tmp_path / "out"
    assert builtin_cli.main([kind, "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m data_pipeline.builtin: error:") and message in err[0]
    assert not out.exists()  # nothing written, not even the folder
    with pytest.raises(ValueError, match="out of range"):
        builtin.ensure(kind, tmp_path / "direct", num_classes=formula.MAX_CLASSES + 1)
    assert not (tmp_path / "direct").exists()


@pytest.mark.parametrize("kind", ["rcdb", "fractal"])
def test_measure_generation_reports_images_per_second(kind):
    assert formula.measure_generation(kind, 32, 4) > 0
    with pytest.raises(ValueError, match="unknown formula kind"):
        formula.measure_generation("mandelbrot", 32, 4)
    with pytest.raises(ValueError, match="resolution"):
        formula.measure_generation(kind, 8, 4)
