"""Augmentation: crop geometry, decode paths (with JPEG draft), RandAugment ops, batch mixup."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from data_pipeline.stream.augment import (
    RANDAUGMENT_OPS,
    AugmentConfig,
    channels_first,
    crop_resize,
    decode_eval,
    decode_eval_image,
    decode_train,
    decode_train_image,
    drafted,
    inception_crop_box,
    mixup,
    pixel_box,
    randaugment,
    rgb_array,
    to_float_images,
)


def jpeg(width, height, colour=(200, 30, 30), border=None) -> bytes:
    img = Image.new("RGB", (width, height), colour)
    if border is not None:  # a frame of another colour, 1/8 of each side
        inner = Image.new("RGB", (width * 6 // 8, height * 6 // 8), colour)
        img = Image.new("RGB", (width, height), border)
        img.paste(inner, (width // 8, height // 8))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=95)
    return out.getvalue()


def test_inception_crop_respects_area_and_aspect_ranges():
    cfg = AugmentConfig(area_min=0.2, area_max=0.6)
    rng = np.random.default_rng(0)
    for _ in range(200):
        left, top, right, bottom = inception_crop_box(400, 300, rng, cfg)
        w, h = right - left, bottom - top
        assert 0 <= left and 0 <= top and right <= 400 + 1e-9 and bottom <= 300 + 1e-9
        assert 0.2 - 1e-9 <= w * h / (400 * 300) <= 0.6 + 1e-9
        assert cfg.aspect_min - 1e-9 <= w / h <= cfg.aspect_max + 1e-9


def test_decode_train_is_a_pure_function_of_the_rng_and_uses_draft_on_large_jpegs():
    data = jpeg(1600, 1200)
    cfg = AugmentConfig(randaugment_n=2, randaugment_m=10)
    a = decode_train(data, 32, cfg, np.random.default_rng([1, 2, 3]))
    b = decode_train(data, 32, cfg, np.random.default_rng([1, 2, 3]))
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    plain = decode_train(data, 32, None, np.random.default_rng(0))  # no crop: draft decodes at 1/8 scale
    assert np.abs(plain.astype(int) - [200, 30, 30]).max() <= 6


def test_drafted_decodes_at_the_largest_reduction_that_keeps_the_crop_and_rescales_the_box():
    data = jpeg(800, 600)
    box = (100.0, 60.0, 500.0, 460.0)  # 400 x 400 crop
    img, scaled = drafted(Image.open(io.BytesIO(data)), box, 100)  # 4 x the output: 1/4 scale
    assert img.size == (200, 150) and scaled == pytest.approx((25.0, 15.0, 125.0, 115.0))
    img, scaled = drafted(Image.open(io.BytesIO(data)), box, 150)  # 400 / 150 = 2.7: only 1/2 keeps >= 150
    assert img.size == (400, 300) and min(scaled[2] - scaled[0], scaled[3] - scaled[1]) >= 150
    img, scaled = drafted(Image.open(io.BytesIO(data)), box, 201)  # under 2 x the output: full size, same box
    assert img.size == (800, 600) and scaled == box
    png = io.BytesIO()
    Image.new("RGB", (800, 600)).save(png, format="PNG")
    img, scaled = drafted(Image.open(png), box, 100)  # not a JPEG: nothing to draft
    assert img.size == (800, 600) and scaled == box


def test_scaled_decode_is_an_explicit_choice_with_the_same_output_shape():
    data = jpeg(1600, 1200, border=(0, 0, 255))
    rng = lambda: np.random.default_rng([4, 5])  # noqa: E731
    scaled = decode_train(data, 32, AugmentConfig(), rng())
    again = decode_train(data, 32, AugmentConfig(), rng())
    full = decode_train(data, 32, AugmentConfig(scaled_decode=False), rng())
    assert scaled.shape == full.shape == (32, 32, 3) and np.array_equal(scaled, again)
    assert np.abs(scaled.astype(int) - full.astype(int)).mean() < 8  # same crop, slightly different pixels
    assert decode_eval(data, 32, scaled_decode=False).shape == (32, 32, 3)


def test_decode_eval_resizes_then_centre_crops():
    data = jpeg(64, 64, colour=(0, 0, 255), border=(255, 255, 0))
    whole = decode_eval(data, 32)  # straight resize keeps the yellow frame
    cropped = decode_eval(data, 32, resize_size=48)  # keeps the central 2/3: no frame left
    assert whole[0, 16, 0] > 200 and cropped[0, 16, 0] < 40 and cropped[16, 16, 2] > 200
    with pytest.raises(ValueError, match="resize_size"):
        decode_eval(data, 32, resize_size=16)


def test_every_randaugment_op_runs_and_keeps_size():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 24, 3), dtype=np.uint8))
    for m in (0, 10, 30):
        out = randaugment(img, len(RANDAUGMENT_OPS) * 3, m, np.random.default_rng(m))
        assert out.size == (24, 24) and out.mode == "RGB"


def test_a_training_image_as_an_array_packs_as_its_pil_image_does():
    """`augmented` keeps the resized array (RGB, RGB + padding, grey; a flip is a reversed view): packed into planes
    it gives what the PIL image of the same pixels gave, as a grey image converted to RGB repeats its one plane."""
    rng = np.random.default_rng(1)
    rgbx = rng.integers(0, 256, (5, 5, 4), dtype=np.uint8)
    grey = rng.integers(0, 256, (5, 5, 1), dtype=np.uint8)
    arrays = [rgbx, rgbx[:, :, :3].copy(), grey, rgbx[:, ::-1], grey[:, ::-1]]
    images = [
        Image.fromarray(rgbx[:, :, :3]),
        Image.fromarray(rgbx[:, :, :3]),
        Image.fromarray(grey[:, :, 0]).convert("RGB"),
        Image.fromarray(rgbx[:, :, :3]).transpose(Image.Transpose.FLIP_LEFT_RIGHT),
        Image.fromarray(grey[:, :, 0]).convert("RGB").transpose(Image.Transpose.FLIP_LEFT_RIGHT),
    ]
    got = channels_first(arrays, out=np.empty((5, 3, 5, 5), np.uint8))
    assert np.array_equal(got, channels_first(images, out=np.empty((5, 3, 5, 5), np.uint8)))
    for array, image in zip(arrays, images):
        assert np.array_equal(rgb_array(array), np.asarray(image)) and rgb_array(array).flags.c_contiguous


def test_channels_first_writes_each_image_transposed_into_its_row():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (6, 6, 3), dtype=np.uint8) for _ in range(2)]
    out = np.full((3, 3, 6, 6), 77, np.uint8)  # one row more than images: left as it was
    rows = channels_first([Image.fromarray(a) for a in arrays], out=out)
    assert rows.shape == (2, 3, 6, 6) and np.shares_memory(rows, out)
    assert np.array_equal(rows, np.stack(arrays).transpose(0, 3, 1, 2)) and (out[2] == 77).all()
    data = photo_jpeg(300, 200, seed=1)
    assert np.array_equal(  # the images the loader writes are decode_train's / decode_eval's pixels
        channels_first(
            [decode_train_image(data, 32, AugmentConfig(), np.random.default_rng(3))],
            np.empty((1, 3, 32, 32), np.uint8),
        )[0],
        decode_train(data, 32, AugmentConfig(), np.random.default_rng(3)).transpose(2, 0, 1),
    )
    assert np.array_equal(
        channels_first([decode_eval_image(data, 32, 48)], np.empty((1, 3, 32, 32), np.uint8))[0],
        decode_eval(data, 32, 48).transpose(2, 0, 1),
    )


def test_to_float_images_scales_to_minus_one_one():
    batch = np.array([[[[0, 255, 127]]]], dtype=np.uint8)  # (1, 1, 1, 3)
    x = to_float_images(batch)
    assert x.shape == (1, 3, 1, 1) and x.is_contiguous()
    assert torch.allclose(x.flatten(), torch.tensor([-1.0, 1.0, 127 / 127.5 - 1]), atol=1e-6)


def test_to_float_images_of_pieces_equals_the_whole_array_bit_for_bit():
    batch = np.random.default_rng(0).integers(0, 256, (7, 5, 5, 3), dtype=np.uint8)
    chw = torch.from_numpy(batch).permute(0, 3, 1, 2)  # (7, 3, 5, 5)
    pieces = [chw[:2].contiguous(), chw[2:3], chw[3:].contiguous()]  # channels-first, any layout
    whole = to_float_images(batch)
    out = torch.full((7, 3, 5, 5), float("nan"))
    assert to_float_images(pieces, out=out) is out and torch.equal(out, whole) and out.is_contiguous()
    # the conversion the loader did in its workers before: a float copy, then the two in-place steps
    before = torch.from_numpy(batch).permute(0, 3, 1, 2).float().mul_(1 / 127.5).sub_(1.0)
    assert torch.equal(whole, before)
    with pytest.raises(ValueError, match=r"out must be a contiguous float32 tensor \(7, 3, 5, 5\)"):
        to_float_images(pieces, out=torch.empty(6, 3, 5, 5))


def test_mixup_keeps_the_original_dominant_and_targets_normalised():
    images = torch.randn(4, 3, 8, 8)
    targets = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 3]), 5).float()
    mixed, soft, lam = mixup(images, targets, 0.4, np.random.default_rng(0))
    assert 0.5 <= lam <= 1.0
    assert torch.allclose(mixed[1], lam * images[1] + (1 - lam) * images[0])
    assert torch.allclose(soft.sum(1), torch.ones(4)) and soft.argmax(1).tolist() == [0, 1, 2, 3]


def test_augment_config_validation_names_the_field():
    with pytest.raises(ValueError, match="area_min"):
        AugmentConfig(area_min=0).validate()
    with pytest.raises(ValueError, match="aspect"):
        AugmentConfig(aspect_min=2, aspect_max=1).validate()
    with pytest.raises(ValueError, match="randaugment"):
        AugmentConfig(randaugment_m=31).validate()
    assert math.isclose(AugmentConfig().aspect_max, 4 / 3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_data_writes_the_documented_keys(tmp_path):
    """bench.data end to end at a tiny size (80 JPEGs, 32 px output, one round, loader with 1 and 2 workers)."""
    import json

    from bench.data import main

    out = tmp_path / "data.json"
    assert main(["--images", "80", "--size", "32", "--rounds", "1", "--loader-copies", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in (
        "ratio",
        "ratio_uint8",
        "ratio_randaugment",
        "ratio_full_decode",
        "workers_2_over_1",
        "pil_img_s_per_core",
        "pipeline_img_s_per_core",
        "loader_img_s_workers1",
        "loader_img_s_workers2",
        "read_mb_s",
        *(f"decode_us_scale_{n}_8" for n in range(4, 9)),
    ):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["ratio"] == pytest.approx(result["pipeline_img_s_per_core"] / result["pil_img_s_per_core"], rel=0.01)
    assert result["ratio_uint8"] == pytest.approx(
        result["pipeline_uint8_img_s_per_core"] / result["pil_img_s_per_core"], rel=0.01
    )
    assert 0.5 < result["scaled_decode_fraction"] <= 1  # ~375 px JPEGs cropped to 32 px: most crops decode scaled
    assert result["short_side_max"] <= 512 and result["loader_samples"] == 160


def test_bench_data_dali_without_dali_is_one_clear_error_before_any_timing(tmp_path, monkeypatch, capsys):
    import sys

    from bench.data import main

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # as where DALI is not installed: import fails
    out = tmp_path / "data.json"
    assert main(["--images", "80", "--size", "32", "--rounds", "1", "--dali", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "pip install nvidia-dali-cuda120" in err and "--dali" in err
    assert not out.exists()


def photo_jpeg(width, height, seed, **save) -> bytes:
    """bench.images' photo-like pixels, so every row decodes to different pixels, saved with ``save`` (+ ``mode``)."""
    from bench.images import photo_like

    pixels = photo_like(width, height, (9, 11), 12.0, np.random.default_rng(seed))
    out = io.BytesIO()
    Image.fromarray(pixels).convert(save.pop("mode", "RGB")).save(out, format="JPEG", **save)
    return out.getvalue()


@pytest.mark.parametrize(
    "save",
    [
        dict(quality=90),  # 4:2:0, 16-row iMCUs
        dict(quality=95, subsampling=0),  # 4:4:4
        dict(quality=85, subsampling=1),  # 4:2:2
        dict(quality=90, mode="L"),  # grayscale, 8-row iMCUs
        dict(quality=90, restart_marker_rows=1),  # restart markers inside the scan
        dict(quality=90, progressive=True),  # decoded whole (every scan covers the image), through simplejpeg
        dict(quality=90, mode="CMYK"),  # PIL's decoder: simplejpeg takes RGB and grayscale only
    ],
)
def test_decoding_only_the_rows_the_crop_reads_through_simplejpeg_is_bit_identical_to_pil(monkeypatch, save):
    import data_pipeline.stream.augment as augment

    sizes = [(517, 389), (390, 700), (260, 900)]  # landscape, portrait, and tall enough for Pillow's vertical-first
    cases = [(photo_jpeg(w, h, seed, **dict(save)), seed) for seed, (w, h) in enumerate(sizes)]
    cfgs = [AugmentConfig(), AugmentConfig(area_min=0.05, area_max=0.3), AugmentConfig(scaled_decode=False)]
    outputs = []
    for cut in (True, False):
        if not cut:
            # PIL decodes it all, for training (crop_resize reads the PIL image) and evaluation (decoded_rows) alike
            monkeypatch.setattr(augment, "decoded_pixels", lambda img, data, box, size, full: img)
        outputs.append(
            [
                [decode_train(data, size, cfg, np.random.default_rng([seed, i])) for i in range(12) for cfg in cfgs]
                + [decode_eval(data, size, resize) for resize in (None, 256, 4 * size)]
                for data, seed in cases
                for size in (32, 96, 224)
            ]
        )
    assert all(np.array_equal(a, b) for a, b in zip(outputs[0], outputs[1], strict=True) for a, b in zip(a, b))


@pytest.mark.parametrize("channels", [4, 3, 1])
def test_crop_resize_is_pils_bilinear_filter_on_the_crop_alone(channels):
    """PyTorch's uint8 antialiased bilinear kernel against PIL resizing the same whole-pixel crop: within 1 grey
    level, on at most 1.8% of values here; shrinking, enlarging and neither. The pixels around the crop are never
    read."""
    rgb = np.array(Image.open(io.BytesIO(photo_jpeg(400, 300, 0, quality=90))))
    pixels = {4: np.dstack([rgb, np.zeros_like(rgb[:, :, :1])]), 3: rgb, 1: rgb[:, :, :1].copy()}[channels]
    image = Image.fromarray(rgb if channels > 1 else rgb[:, :, 0])
    for box, size in [
        ((10.4, 20.6, 310.2, 270.9), 224),
        ((100, 50, 180, 120), 224),
        ((0, 0, 400, 300), 96),
        ((50, 40, 274, 264), 224),
    ]:
        whole = pixel_box(box, 400, 300)
        expected = np.asarray(image.crop(whole).resize((size, size), Image.BILINEAR)).reshape(size, size, -1)
        got = crop_resize(pixels, box, size)
        assert got.shape == (size, size, channels) and got.flags.c_contiguous
        diff = np.abs(got[:, :, :3].astype(int) - expected.astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.03, (box, diff.max(), (diff > 0).mean())  # measured <= 1.8%
        outside = pixels.copy()
        left, top, right, bottom = whole
        outside[:top], outside[bottom:], outside[:, :left], outside[:, right:] = 0, 255, 0, 255
        assert np.array_equal(crop_resize(outside, box, size), got)
    from_pil = crop_resize(image, (0, 0, 400, 300), 32)  # a PIL image in: its array, 3 or 1 channels
    assert np.array_equal(from_pil, crop_resize(pixels, (0, 0, 400, 300), 32)[:, :, : from_pil.shape[2]])


def test_pixel_box_rounds_inside_the_image_and_keeps_a_pixel():
    assert pixel_box((10.4, 20.6, 310.2, 270.5), 400, 300) == (10, 21, 310, 270)
    assert pixel_box((-0.4, -3.0, 401.0, 300.4), 400, 300) == (0, 0, 400, 300)
    assert pixel_box((399.8, 299.9, 399.9, 300.0), 400, 300) == (399, 299, 400, 300)  # at least one pixel


def test_decoded_rows_stops_the_decoder_below_the_crop_and_leaves_other_images_alone():
    from data_pipeline.stream.augment import decoded_rows, jpeg_height_offset

    data = photo_jpeg(400, 600, 0, quality=90)
    assert int.from_bytes(data[jpeg_height_offset(data) :][:2], "big") == 600
    img = decoded_rows(Image.open(io.BytesIO(data)), data, (10.0, 20.0, 210.0, 220.0), 100, (400, 600))
    assert img.size == (400, 220 + 2 + 1 + 16)  # bottom + support (200 / 100 rows) + 1, then one iMCU row of margin
    img.load()  # decodes without error: the rest of the scan is skipped as extraneous bytes
    at_bottom = decoded_rows(Image.open(io.BytesIO(data)), data, (10.0, 390.0, 210.0, 590.0), 100, (400, 600))
    assert at_bottom.size == (400, 600)  # the rows it reads (and the margin) reach the bottom: nothing to cut
    tall = photo_jpeg(300, 900, 0, quality=90)  # Pillow resizes it vertical pass first; the cut must keep that
    img = decoded_rows(Image.open(io.BytesIO(tall)), tall, (10.0, 20.0, 210.0, 220.0), 100, (300, 900))
    assert img.size == (300, 100 + 2 * (300 - 100) + 1 + 16)
    progressive = io.BytesIO()
    Image.open(io.BytesIO(data)).save(progressive, format="JPEG", progressive=True)
    assert jpeg_height_offset(progressive.getvalue()) is None  # every scan covers the whole image: no cut
    png = io.BytesIO()
    Image.new("RGB", (400, 600)).save(png, format="PNG")
    assert jpeg_height_offset(png.getvalue()) is None and jpeg_height_offset(b"\xff\xd8\x00") is None


def test_a_truncated_jpeg_is_an_error_even_where_the_decoder_stops_early_and_trailing_bytes_are_not():
    from data_pipeline.stream.augment import jpeg_truncated

    data = photo_jpeg(400, 300, 0, quality=90)
    progressive = io.BytesIO()
    Image.open(io.BytesIO(data)).save(progressive, format="JPEG", progressive=True, quality=90)
    for whole in (data, progressive.getvalue()):
        assert not jpeg_truncated(whole)
        for fraction in (0.3, 0.7, 0.99):
            cut = whole[: int(len(whole) * fraction)]
            assert jpeg_truncated(cut)
            for decode in (
                lambda x: decode_train(x, 32, AugmentConfig(), np.random.default_rng(0)),  # mostly drafted: PIL
                lambda x: decode_train(x, 224, AugmentConfig(scaled_decode=False), np.random.default_rng(0)),
                lambda x: decode_eval(x, 224),  # undrafted: simplejpeg, cut to the crop's rows when sequential
            ):
                with pytest.raises(OSError, match="truncated"):
                    decode(cut)
    padded = data + b"\0" * 100  # bytes after the end-of-image marker: PIL decodes such files; so do we
    assert not jpeg_truncated(padded)
    assert np.array_equal(decode_eval(padded, 224), decode_eval(data, 224))


@pytest.mark.parametrize("m", [15, 30])
def test_randaugment_past_magnitude_10_never_inverts_or_blackens_an_image(m):
    """AugReg's L/16 recipe is RandAugment(2, 15): a colour, contrast, brightness or sharpness factor 1 - 0.09 m
    below 0 turned an image black (brightness) or inverted it; timm floors the factor at 0.1."""
    img = Image.fromarray(np.random.default_rng(0).integers(30, 226, (24, 24, 3), dtype=np.uint8))
    before = np.asarray(img, dtype=np.float64).ravel()
    weakened = set()
    for seed in range(400):
        rng = np.random.default_rng(seed)
        op = RANDAUGMENT_OPS[int(rng.integers(len(RANDAUGMENT_OPS), size=1)[0])]
        if op not in ("color", "contrast", "brightness", "sharpness"):
            continue
        after = np.asarray(randaugment(img, 1, m, np.random.default_rng(seed)), dtype=np.float64).ravel()
        assert np.corrcoef(before, after)[0, 1] > 0, (op, seed)
        if after.std() < before.std() or after.mean() < before.mean():
            weakened.add(op)
    assert {"contrast", "brightness"} <= weakened  # the negative draws were among them
