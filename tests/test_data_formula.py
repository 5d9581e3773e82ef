"""Formula-driven pre-training sets (rcdb, fractal): same bytes per seed, sizes, parallel = serial, bad sizes fail."""

from __future__ import annotations

import pytest

from data_pipeline import builtin, formula
from data_pipeline.manifest import read_dataset_info
from data_pipeline.stream import EvalStream
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
    alone = formula._generate_classes(("rcdb", 0, "train", [7], 2, 32))  # class 7 without classes 0-6
    assert alone == [item for item in serial if item[1] == 7]
    assert (
        formula._generate_classes(("fractal", 0, "val", [3], 1, 32))
        == formula.generate("fractal", 0, "val", 4, 1, 32)[3:]
    )


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
    assert builtin.main([kind, "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("data_pipeline.builtin: error:") and message in err[0]
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
