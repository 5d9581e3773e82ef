"""data_pipeline.stream.loader_rate: the loader's images/s on one core, measured on real shards (or synthetic ones
written by the project's writer when the set is not readable), bounded, and cached per machine like the GEMM peak."""

from __future__ import annotations

import json
import time

import pytest

from data_pipeline.manifest import read_dataset_info
from data_pipeline.stream.augment import AugmentConfig
from data_pipeline.stream.loader_rate import MEASURE_SECONDS, cache_fits, cache_path, cpu_model, loader_rate

AUGMENT = AugmentConfig(area_min=0.9, aspect_min=0.9, aspect_max=1.1, flip=False)  # local_demo's


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "loader_rate.json"


@pytest.mark.timeout(120)
def test_the_rate_is_measured_once_on_the_runs_shards_and_cached_per_machine(tiny_fractal_shards, own_cache):
    assert cache_path() == own_cache
    began = time.process_time()
    first = loader_rate(tiny_fractal_shards, 32, AUGMENT)
    spent = time.process_time() - began
    assert first.img_s_per_core > 0 and spent < MEASURE_SECONDS + 2.5  # bounded: a dry run stays quick
    assert first.source == f"this CPU, one core, 32px from its shards (measured now; {own_cache})"
    again = loader_rate(tiny_fractal_shards, 32, AUGMENT)
    assert again.img_s_per_core == first.img_s_per_core and "(measured earlier;" in again.source
    (key,) = json.loads(own_cache.read_text())
    assert key.startswith(cpu_model() + " | ") and "| 32px |" in key and "area_min=0.9" in key
    assert key.endswith("| shards") and "fractal 64 samples" in key
    # another resolution, another augmentation: measured (and kept) apart
    loader_rate(tiny_fractal_shards, 16, AUGMENT)
    loader_rate(tiny_fractal_shards, 32, None)
    assert len(json.loads(own_cache.read_text())) == 3


@pytest.mark.timeout(120)
def test_a_run_that_holds_its_set_decoded_is_timed_from_the_cache(tiny_fractal_shards, own_cache):
    info = read_dataset_info(tiny_fractal_shards)
    assert cache_fits(info, 32, 256) and not cache_fits(info, 32, 0) and not cache_fits(info, 32, 0.01)
    cached = loader_rate(tiny_fractal_shards, 32, AUGMENT, cache_mb=256)
    assert "32px from its decoded cache (measured now" in cached.source and cached.img_s_per_core > 0
    (key,) = json.loads(own_cache.read_text())
    assert key.endswith("| decoded cache")
    loader_rate(tiny_fractal_shards, 32, AUGMENT, cache_mb=0.01)  # over the limit: the run reads its shards
    assert sum(k.endswith("| shards") for k in json.loads(own_cache.read_text())) == 1


@pytest.mark.timeout(120)
def test_an_unreadable_set_is_timed_on_synthetic_shards_and_a_damaged_cache_file_is_measured_again(tmp_path, own_cache):
    own_cache.parent.mkdir(parents=True)
    own_cache.write_text("{not json")
    rate = loader_rate(tmp_path / "absent", 32, AUGMENT, cache_mb=256, synthetic_side=40)
    assert rate.img_s_per_core > 0
    assert rate.source == f"this CPU, one core, 32px synthetic 40px JPEGs (measured now; {own_cache})"
    (key,) = json.loads(own_cache.read_text())
    assert "| synthetic 40px JPEGs |" in key and key.endswith("| shards")
    assert loader_rate(None, 32, AUGMENT, synthetic_side=40).source.endswith(f"(measured earlier; {own_cache})")
