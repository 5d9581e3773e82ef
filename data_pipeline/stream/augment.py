"""Decode and augmentation of one image (docs/reference.md §6), packing, float conversion, and batch mixup."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import simplejpeg
import torch
from PIL import Image, ImageEnhance, ImageOps

# What a damaged or hostile image raises (a corrupt sample)
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
_BILINEAR = Image.Resampling.BILINEAR
# uint8 (S, S, C), C = 1 grey, 3 RGB or 4 RGB + padding, or an RGB PIL image (RandAugment)
TrainImage = np.ndarray | Image.Image


@dataclass(frozen=True)
class AugmentConfig:
    inception_crop: bool = True  # False: resize the whole image to the output size
    area_min: float = 0.05  # lower bound of the crop's share of the image area (ViT/BiT: 5%)
    area_max: float = 1.0
    aspect_min: float = 0.75  # crop aspect ratio w/h, sampled log-uniformly
    aspect_max: float = 4 / 3
    flip: bool = True  # horizontal flip with probability 1/2
    randaugment_n: int = 0  # RandAugment ops per image; 0: off
    randaugment_m: int = 0  # RandAugment magnitude, 0-30 (10 is the usual "full" strength)
    scaled_decode: bool = True  # JPEG at 1/2-1/8 DCT scale while the crop stays >= the output size (other pixels)

    def validate(self) -> None:
        if not 0 < self.area_min <= self.area_max <= 1:
            raise ValueError(
                f"augment.area_min/area_max must satisfy 0 < min <= max <= 1, got {self.area_min}/{self.area_max}"
            )
        if not 0 < self.aspect_min <= self.aspect_max:
            raise ValueError(
                f"augment.aspect_min/aspect_max must satisfy 0 < min <= max, got {self.aspect_min}/{self.aspect_max}"
            )
        if self.randaugment_n < 0 or not 0 <= self.randaugment_m <= 30:
            raise ValueError(
                f"augment.randaugment_n must be >= 0 and randaugment_m in [0, 30], got "
                f"{self.randaugment_n}/{self.randaugment_m}"
            )


def inception_crop_box(width: int, height: int, rng: np.random.Generator, cfg: AugmentConfig) -> tuple:
    """A random crop box; after 10 failed draws, the largest centred crop in range."""
    area = width * height
    log_lo, log_hi = math.log(cfg.aspect_min), math.log(cfg.aspect_max)
    for _ in range(10):
        target = area * rng.uniform(cfg.area_min, cfg.area_max)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w, h = math.sqrt(target * aspect), math.sqrt(target / aspect)
        if w <= width and h <= height:
            left, top = rng.uniform(0, width - w), rng.uniform(0, height - h)
            return (left, top, left + w, top + h)
    ratio = width / height
    if ratio < cfg.aspect_min:
        w, h = width, width / cfg.aspect_min
    elif ratio > cfg.aspect_max:
        w, h = height * cfg.aspect_max, height
    else:
        w, h = width, height
    return ((width - w) / 2, (height - h) / 2, (width + w) / 2, (height + h) / 2)


def drafts(image_format: str | None, box: tuple, size: int) -> bool:
    """Whether `drafted` reduces the DCT scale."""
    return image_format == "JPEG" and min(box[2] - box[0], box[3] - box[1]) >= 2 * size


def drafted(img: Image.Image, box: tuple, size: int) -> tuple[Image.Image, tuple]:
    """(image drafted to the smallest DCT scale leaving the crop >= ``size``, box rescaled)."""
    if drafts(img.format, box, size):
        width, height = img.size
        factor = min(box[2] - box[0], box[3] - box[1]) / size
        img.draft("RGB", (math.ceil(width / factor), math.ceil(height / factor)))
        sx, sy = img.size[0] / width, img.size[1] / height
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    return img, box


def _segments(data: bytes):
    if data[:2] != b"\xff\xd8":
        return
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        yield marker, i
        if marker in (0xD9, 0xDA):
            return
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")


def jpeg_height_offset(data: bytes) -> int | None:
    """Offset of the frame height of a sequential Huffman JPEG (SOF0/SOF1), else None."""
    for marker, i in _segments(data):
        if marker in (0xC0, 0xC1):
            return i + 5 if i + 7 <= len(data) and data[i + 5 : i + 7] != b"\0\0" else None
        if 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xCC):
            return None
    return None


def jpeg_truncated(data: bytes) -> bool:
    """Whether a JPEG has no FF D9 after its first scan header (missed by a decoder told to stop early)."""
    scan = next((i for marker, i in _segments(data) if marker == 0xDA), None)
    return scan is not None and data.rfind(b"\xff\xd9") < scan


def decoded_rows(img: Image.Image, data: bytes, box: tuple, size: int, full_size: tuple[int, int]) -> Image.Image:
    pixels = decoded_pixels(img, data, box, size, full_size)
    return pixels if isinstance(pixels, Image.Image) else pixels_image(pixels)


def pixels_image(pixels: np.ndarray) -> Image.Image:
    if pixels.shape[2] == 4:
        return rgbx_image(pixels)
    return Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)


def decoded_pixels(
    img: Image.Image, data: bytes, box: tuple, size: int, full_size: tuple[int, int]
) -> np.ndarray | Image.Image:
    """``img`` decoded down to the last row resizing ``box`` to ``size`` reads, bit-identical to a full decode:
    uint8 (H, W, 4 or 1) for undrafted RGB/grey JPEGs, else a PIL image."""
    if img.format != "JPEG":
        img.load()
        return img
    if jpeg_truncated(data):
        raise OSError("image file is truncated: no end-of-image marker after the scan data")
    width, height = img.size
    full_width, full_height = full_size
    offset = jpeg_height_offset(data)
    scale = next((s for s in (1, 2, 4, 8) if -(-full_width // s) == width), None)  # the draft's DCT scale
    rows = full_height
    if offset is not None and scale is not None:
        # The resize reads to bottom + max(box height / size, 1) + 0.5; one iMCU row more (chroma upsampling).
        last = box[3] + max((box[3] - box[1]) / size, 1.0) + 1
        if height - size > 2 * (width - size) and height > size:
            # Pillow resizes such a tall image vertical pass first (the other order rounds differently).
            last = max(last, size + 2 * (width - size) + 1)
        rows = min(math.ceil(last * scale) + 16, full_height)
    if offset is not None and rows < full_height:
        data = data[:offset] + rows.to_bytes(2, "big") + data[offset + 2 :]
    if scale == 1 and img.mode in ("RGB", "L"):
        # strict=False: scan data past the new height only warns
        return simplejpeg.decode_jpeg(data, colorspace="GRAY" if img.mode == "L" else "RGBX", strict=False)
    if rows < full_height:
        cut = Image.open(io.BytesIO(data))
        if scale is not None and scale > 1:
            cut.draft("RGB", (full_width // scale, rows // scale))
        if cut.size[0] == width and cut.mode == img.mode:
            img = cut
    img.load()
    return img


def rgbx_image(pixels: np.ndarray) -> Image.Image:
    """An RGB image over a C-contiguous uint8 (H, W, 4) RGB + padding array, without a copy."""
    height, width, _ = pixels.shape
    values = pa.Array.from_buffers(pa.uint8(), pixels.size, [None, pa.py_buffer(pixels)])
    return Image.fromarrow(pa.FixedSizeListArray.from_arrays(values, 4), "RGB", (width, height))


def pixel_box(box: tuple, width: int, height: int) -> tuple[int, int, int, int]:
    """``box`` in whole pixels inside the image, at least one pixel wide and high."""
    left = min(max(round(box[0]), 0), width - 1)
    top = min(max(round(box[1]), 0), height - 1)
    right = min(max(round(box[2]), left + 1), width)
    bottom = min(max(round(box[3]), top + 1), height)
    return left, top, right, bottom


def pixel_array(pixels: np.ndarray | Image.Image) -> np.ndarray:
    if isinstance(pixels, Image.Image):
        pixels = np.array(pixels.convert("RGB") if pixels.mode not in ("RGB", "L") else pixels)
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


def crop_resize(pixels: np.ndarray | Image.Image, box: tuple, size: int) -> np.ndarray:
    """`pixel_box` of ``box`` resized by torch's antialiased bilinear kernel (PIL's within 1); uint8 (size, size, C)."""
    pixels = pixel_array(pixels)
    left, top, right, bottom = pixel_box(box, pixels.shape[1], pixels.shape[0])
    crop = torch.from_numpy(pixels).permute(2, 0, 1)[None, :, top:bottom, left:right]
    crop = crop.contiguous(memory_format=torch.channels_last)  # the kernel's fast path
    out = torch.nn.functional.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)
    return np.ascontiguousarray(out[0].permute(1, 2, 0).numpy())


def decode_train(data: bytes, size: int, cfg: AugmentConfig | None, rng: np.random.Generator) -> np.ndarray:
    """JPEG bytes -> augmented uint8 (size, size, 3); one of ``DECODE_ERRORS`` on a corrupt image."""
    return rgb_array(decode_train_image(data, size, cfg, rng))


def decode_train_image(data: bytes, size: int, cfg: AugmentConfig | None, rng: np.random.Generator) -> TrainImage:
    img: Image.Image = Image.open(io.BytesIO(data))  # lazy
    width, height = img.size
    box = train_box(width, height, cfg, rng)
    if cfg is None or cfg.scaled_decode:
        img, box = drafted(img, box, size)
    return augmented(decoded_pixels(img, data, box, size, (width, height)), box, size, cfg, rng)


def train_box(width: int, height: int, cfg: AugmentConfig | None, rng: np.random.Generator) -> tuple:
    if cfg is not None and cfg.inception_crop:
        return inception_crop_box(width, height, rng, cfg)
    return (0, 0, width, height)


def augmented(
    pixels: np.ndarray | Image.Image, box: tuple, size: int, cfg: AugmentConfig | None, rng: np.random.Generator
) -> TrainImage:
    """``box`` resized to ``size``, flipped, RandAugment (docs/performance.md, "No PIL image on the way")."""
    resized = crop_resize(pixels, box, size)
    flip = cfg is not None and cfg.flip and rng.random() < 0.5
    if cfg is None or cfg.randaugment_n == 0:
        return resized[:, ::-1] if flip else resized
    img = pixels_image(resized)
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return randaugment(img.convert("RGB"), cfg.randaugment_n, cfg.randaugment_m, rng)


def decode_whole(data: bytes) -> tuple[np.ndarray, str | None]:
    """(all pixels, uint8 (H, W, C); PIL's format); raises where `decode_train_image` would."""
    img: Image.Image = Image.open(io.BytesIO(data))
    width, height = img.size
    return pixel_array(decoded_pixels(img, data, (0, 0, width, height), 1, (width, height))), img.format


def decoded_train_image(
    pixels: np.ndarray,
    image_format: str | None,
    data: bytes | None,
    size: int,
    cfg: AugmentConfig | None,
    rng: np.random.Generator,
) -> TrainImage:
    """`decode_train_image` of a `decode_whole` image, bit-identical; a crop that `drafts` needs ``data``."""
    height, width = pixels.shape[:2]
    may_draft = (cfg is None or cfg.scaled_decode) and drafts(image_format, (0, 0, width, height), size)
    state = rng.bit_generator.state if may_draft else None  # replayed by the decode from bytes
    box = train_box(width, height, cfg, rng)
    if may_draft and drafts(image_format, box, size):
        if data is None:
            raise ValueError(f"a {width}x{height} crop to {size} px decodes at a reduced scale: pass its bytes")
        assert state is not None
        rng.bit_generator.state = state
        return decode_train_image(data, size, cfg, rng)
    return augmented(pixels, box, size, cfg, rng)


def decode_eval(data: bytes, size: int, resize_size: int | None = None, scaled_decode: bool = True) -> np.ndarray:
    """Square resize to ``resize_size`` (None: ``size``) and centre crop ``size``; uint8 (size, size, 3)."""
    return np.asarray(decode_eval_image(data, size, resize_size, scaled_decode))


def decode_eval_image(
    data: bytes, size: int, resize_size: int | None = None, scaled_decode: bool = True
) -> Image.Image:
    resize_size = resize_size or size
    if resize_size < size:
        raise ValueError(f"resize_size {resize_size} must be >= image_size {size}")
    img: Image.Image = Image.open(io.BytesIO(data))
    width, height = img.size
    keep = size / resize_size
    w, h = width * keep, height * keep
    box = ((width - w) / 2, (height - h) / 2, (width + w) / 2, (height + h) / 2)
    if scaled_decode:
        img, box = drafted(img, box, size)
    img = decoded_rows(img, data, box, size, (width, height))
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    img = img.resize((size, size), _BILINEAR, box=box)
    return img if img.mode == "RGB" else img.convert("RGB")


def planes(rows: int, size: int) -> np.ndarray:
    return np.empty((rows, 3, size, size), np.uint8)


def rgb_array(image: TrainImage) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB") if image.mode != "RGB" else image)
    return np.ascontiguousarray(np.broadcast_to(image[:, :, :3], (*image.shape[:2], 3)))


def channels_first(images: Sequence[TrainImage], out: np.ndarray) -> np.ndarray:
    """Images -> their rows of uint8 ``out`` (>= len(images), 3, S, S), returned; grey as PIL's RGB."""
    for row, img in zip(out, images):
        if isinstance(img, np.ndarray):
            row[...] = img[:, :, :3].transpose(2, 0, 1)
            continue
        for plane, band in zip(row, "RGB"):
            plane[...] = np.frombuffer(img.tobytes("raw", band), np.uint8).reshape(plane.shape)
    return out[: len(images)]


def _level(m: int, high: float) -> float:
    return m / 10.0 * high


def _signed(value: float, rng: np.random.Generator) -> float:
    return value if rng.random() < 0.5 else -value


def _affine(img: Image.Image, matrix: tuple) -> Image.Image:
    return img.transform(img.size, Image.Transform.AFFINE, matrix, resample=_BILINEAR, fillcolor=(128, 128, 128))


def _enhance(kind):
    # floored as timm's: past magnitude 10 a factor below 0 blackens (brightness) or inverts the image
    return lambda img, m, rng: kind(img).enhance(max(0.1, 1 + _signed(_level(m, 0.9), rng)))


_OPS = {
    "identity": lambda img, m, rng: img,
    "autocontrast": lambda img, m, rng: ImageOps.autocontrast(img),
    "equalize": lambda img, m, rng: ImageOps.equalize(img),
    "rotate": lambda img, m, rng: img.rotate(_signed(_level(m, 30), rng), _BILINEAR, fillcolor=(128,) * 3),
    "solarize": lambda img, m, rng: ImageOps.solarize(img, max(0, 256 - int(_level(m, 256)))),
    "posterize": lambda img, m, rng: ImageOps.posterize(img, max(1, 8 - int(_level(m, 4)))),
    "color": _enhance(ImageEnhance.Color),
    "contrast": _enhance(ImageEnhance.Contrast),
    "brightness": _enhance(ImageEnhance.Brightness),
    "sharpness": _enhance(ImageEnhance.Sharpness),
    "shear_x": lambda img, m, rng: _affine(img, (1, _signed(_level(m, 0.3), rng), 0, 0, 1, 0)),
    "shear_y": lambda img, m, rng: _affine(img, (1, 0, 0, _signed(_level(m, 0.3), rng), 1, 0)),
    "translate_x": lambda img, m, rng: _affine(img, (1, 0, _signed(_level(m, 0.45) * img.size[0], rng), 0, 1, 0)),
    "translate_y": lambda img, m, rng: _affine(img, (1, 0, 0, 0, 1, _signed(_level(m, 0.45) * img.size[1], rng))),
}
RANDAUGMENT_OPS = tuple(_OPS)


def randaugment(img: Image.Image, n: int, m: int, rng: np.random.Generator) -> Image.Image:
    """RandAugment (Cubuk et al. 2020): ``n`` ops drawn with replacement, at magnitude ``m``."""
    for k in rng.integers(len(RANDAUGMENT_OPS), size=n):
        img = _OPS[RANDAUGMENT_OPS[int(k)]](img, m, rng)
    return img


def to_float_images(batch: np.ndarray | list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 (B, S, S, 3) array, or tensors (b_i, 3, S, S) -> float32 (B, 3, S, S) in [-1, 1] (as the ViT
    checkpoints expect), into ``out`` if given."""
    if isinstance(batch, np.ndarray):
        batch = [torch.from_numpy(np.ascontiguousarray(batch)).permute(0, 3, 1, 2)]
    shape = (sum(len(piece) for piece in batch), *batch[0].shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor {shape}; got {out.shape}")
    start = 0
    for piece in batch:  # one converting copy: cheaper than .float()
        out[start : start + len(piece)].copy_(piece)
        start += len(piece)
    return _scale(out)


def _scale(floats: torch.Tensor) -> torch.Tensor:
    """0..255 -> [-1, 1] in place; the one formula, on the host or the device."""
    return floats.mul_(1 / 127.5).sub_(1.0)


def float_images_on(pixels: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _scale(pixels.to(device, non_blocking=True).to(torch.float32))


def mixup_lambda(alpha: float, rng: np.random.Generator) -> float:
    """A weight ~ Beta(alpha, alpha), folded to >= 0.5: the original's label stays the argmax."""
    lam = float(rng.beta(alpha, alpha))
    return max(lam, 1.0 - lam)


def mix(a: torch.Tensor, b: torch.Tensor, lam: float) -> torch.Tensor:
    """lam a + (1 - lam) b, three operations in a's dtype: the host and a GPU give the same bits."""
    return lam * a + (1.0 - lam) * b


def mixup(images: torch.Tensor, targets: torch.Tensor, alpha: float, rng: np.random.Generator):
    """(images, targets (B, K), lam) each mixed with the batch rolled by one."""
    lam = mixup_lambda(alpha, rng)
    return mix(images, images.roll(1, dims=0), lam), mix(targets, targets.roll(1, dims=0), lam), lam
