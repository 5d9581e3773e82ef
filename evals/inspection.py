"""Inspecting a Vision Transformer (paper §4.5, Fig. 6, 7, 10, 11; the analyses: docs/reference.md §4): each a pure
function on arrays plus a figure; the suite entry is ``evaluate``. Attention is ``(B, heads, T, T)``:
``num_prefix_tokens`` leading tokens, then the patch grid row-major. Distances are between patch centres, in pixels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from evals.evaluator import EvalOutput, ResultRow
from evals.features import load_images, resolve_split

__all__ = [
    "InspectConfig",
    "attention_rollout",
    "embedding_filter_components",
    "mean_attention_distance",
    "patch_distances",
    "plot_attention_distance",
    "plot_embedding_filters",
    "plot_position_similarity",
    "plot_rollout",
    "position_similarity",
    "rollout_maps",
    "run_inspection",
]


def patch_distances(grid: tuple[int, int], cell_pixels: float) -> np.ndarray:
    """Pixel distance between every pair of cell centres (row-major) → ``(N, N)``, N = gh·gw."""
    gh, gw = grid
    if gh < 1 or gw < 1 or cell_pixels <= 0:
        raise ValueError(f"grid must be positive and cell_pixels > 0, got grid={grid}, cell_pixels={cell_pixels}")
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    centres = np.stack([rows.ravel(), cols.ravel()], axis=1).astype(np.float64)  # (N, 2)
    diff = centres[:, None, :] - centres[None, :, :]  # (N, N, 2)
    return np.sqrt((diff**2).sum(-1)) * float(cell_pixels)


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def mean_attention_distance(
    attentions: Sequence, grid: tuple[int, int], cell_pixels: float, num_prefix_tokens: int = 1
) -> np.ndarray:
    """Mean attention distance in pixels → ``(layers, heads)``; ``attentions``: a ``(B, heads, T, T)`` per layer.
    Patch queries' weights on patch keys are renormalised (the class token has no position)."""
    dist = patch_distances(grid, cell_pixels)  # (N, N)
    out = []
    for layer, attn in enumerate(attentions):
        out.append(_attention_distance_sum(attn, dist, grid, num_prefix_tokens, layer) / (len(attn) * dist.shape[0]))
    return np.stack(out)  # (L, H)


def _attention_distance_sum(attn, dist: np.ndarray, grid: tuple[int, int], num_prefix_tokens: int, layer: int):
    """Per head, the sum over images and patch queries of the mean distance a query attends at → ``(heads,)``; on
    ``attn``'s device, one layer of one batch at a time, so the memory is bounded by the batch."""
    a = attn.detach() if isinstance(attn, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(attn, np.float64))
    n = dist.shape[0]
    if a.ndim != 4 or a.shape[-1] != a.shape[-2] or a.shape[-1] != n + num_prefix_tokens:
        raise ValueError(
            f"layer {layer}: attention must be (B, heads, T, T) with T = {num_prefix_tokens} + {grid[0]}x"
            f"{grid[1]} = {n + num_prefix_tokens}, got {tuple(a.shape)}; pass the grid the model was run at"
        )
    patch = a[:, :, num_prefix_tokens:, num_prefix_tokens:].to(torch.float64)  # (B, H, N, N)
    mass = patch.sum(-1)
    weighted = (patch * torch.as_tensor(dist, device=patch.device)).sum(-1)  # (B, H, N)
    per_query = torch.where(mass > 0, weighted / mass, 0.0)  # the weights renormalised; all on the class token: 0
    return per_query.sum(dim=(0, 2)).cpu().numpy()


def attention_rollout(attentions: Sequence, residual: bool = True) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020) → ``(B, T, T)``, rows summing to 1."""
    if len(attentions) == 0:
        raise ValueError("attention_rollout needs at least one layer of attention weights")
    rollout = None
    for attn in attentions:
        rollout = _rollout_step(rollout, attn, residual)
    return rollout


def _rollout_step(rollout: torch.Tensor | None, attn, residual: bool = True) -> torch.Tensor:
    """The rollout through one more layer of attention ``(B, heads, T, T)``."""
    a = torch.as_tensor(attn).detach().to(torch.float64).mean(dim=1)  # (B, T, T)
    if residual:
        a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    a = a / a.sum(dim=-1, keepdim=True)
    return a if rollout is None else a @ rollout


def rollout_maps(attentions: Sequence, grid: tuple[int, int], num_prefix_tokens: int = 1) -> np.ndarray:
    """Class-token rollout (``pool="gap"``: the mean row) over the patch grid → ``(B, gh, gw)``, each summing to 1."""
    return _rollout_map(attention_rollout(attentions), grid, num_prefix_tokens)


def _rollout_map(rollout: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> np.ndarray:
    r = rollout[:, 0, num_prefix_tokens:] if num_prefix_tokens else rollout.mean(dim=1)  # (B, N)
    if r.shape[-1] != grid[0] * grid[1]:
        raise ValueError(f"rollout has {r.shape[-1]} patch tokens, grid {grid} needs {grid[0] * grid[1]}")
    r = r / r.sum(-1, keepdim=True).clamp_min(1e-12)
    return r.reshape(-1, *grid).numpy()


def position_similarity(pos_embed, grid: tuple[int, int], num_prefix_tokens: int = 1) -> np.ndarray:
    """Cosine similarity of every pair of patch position embeddings → ``(gh, gw, gh, gw)``."""
    p = _as_numpy(pos_embed).astype(np.float64)
    p = p.reshape(-1, p.shape[-1])[num_prefix_tokens:]  # (N, D)
    if p.shape[0] != grid[0] * grid[1]:
        raise ValueError(f"position embedding has {p.shape[0]} patch slots, grid {grid} needs {grid[0] * grid[1]}")
    unit = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-12)
    return (unit @ unit.T).reshape(grid[0], grid[1], grid[0], grid[1])


def embedding_filter_components(kernel, num_components: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """``(components (k, C, p, p), explained_variance_ratio (k,))`` of the kernel ``(D, C, p, p)``, k <= num_components,
    unit norm, sign arbitrary."""
    w = _as_numpy(kernel).astype(np.float64)
    if w.ndim != 4:
        raise ValueError(f"patch-embedding kernel must be (D, C, p, p), got shape {w.shape}")
    d, c, ph, pw = w.shape
    x = w.reshape(d, -1)
    x = x - x.mean(axis=0, keepdims=True)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    k = min(num_components, vt.shape[0])
    var = s**2
    ratio = var[:k] / max(var.sum(), 1e-30)
    return vt[:k].reshape(k, c, ph, pw), ratio


def _figure(width: float, height: float):
    """Never pyplot: no global backend state, no display."""
    from matplotlib.figure import Figure  # heavy

    return Figure(figsize=(width, height), dpi=120, layout="constrained")


def plot_attention_distance(
    distances: np.ndarray, image_size: int, path: Path, title: str = "", uniform: float | None = None
) -> Path:
    """Fig. 7 right / Fig. 11: mean attention distance per head vs depth; ``uniform``: a dashed reference."""
    layers, heads = distances.shape
    from matplotlib import colormaps  # heavy

    fig = _figure(4.8, 4.0)
    ax = fig.subplots()
    colors = colormaps.get_cmap("tab20" if heads > 10 else "tab10")
    jitter = np.linspace(-0.15, 0.15, heads) if heads > 1 else np.zeros(1)  # equal distances stay visible
    for h in range(heads):
        x = np.arange(1, layers + 1) + jitter[h]
        ax.scatter(x, distances[:, h], s=14, color=colors(h % colors.N), label=f"Head {h + 1}")
    if uniform is not None:
        ax.axhline(uniform, color="0.5", linestyle="--", linewidth=0.8, label="uniform attention")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xlim(0, layers + 1)
    ax.set_ylim(0, max(image_size * 0.6, float(distances.max()) * 1.1))
    ax.set_xticks(np.arange(0, layers + 1, max(1, layers // 6 or 1)))
    if heads <= 16 or uniform is not None:
        ax.legend(fontsize=6, markerscale=0.8, ncol=2 if heads > 8 else 1, loc="lower right", frameon=False)
    ax.set_title(title or f"Mean attention distance ({image_size}px input)", fontsize=10)
    ax.grid(alpha=0.25)
    return _save(fig, path)


def plot_position_similarity(similarity: np.ndarray, path: Path, title: str = "") -> Path:
    """Fig. 7 centre / Fig. 10: tile (r, c) is patch (r, c)'s similarity with every patch."""
    gh, gw = similarity.shape[:2]
    gap = 1
    mosaic = np.full((gh * (gh + gap) - gap, gw * (gw + gap) - gap), np.nan)
    for r in range(gh):
        for c in range(gw):
            y, x = r * (gh + gap), c * (gw + gap)
            mosaic[y : y + gh, x : x + gw] = similarity[r, c]
    side = min(7.0, 2.0 + 0.35 * max(gh, gw))
    from matplotlib import colormaps  # heavy

    fig = _figure(side + 1.0, side)
    ax = fig.subplots()
    cmap = colormaps["viridis"].with_extremes(bad="white")  # the gaps between tiles are NaN
    im = ax.imshow(mosaic, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xticks(np.arange(gw) * (gw + gap) + (gw - 1) / 2, [str(i + 1) for i in range(gw)], fontsize=7)
    ax.set_yticks(np.arange(gh) * (gh + gap) + (gh - 1) / 2, [str(i + 1) for i in range(gh)], fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="Cosine similarity")
    ax.set_title(title or "Position embedding similarity", fontsize=10)
    return _save(fig, path)


def plot_embedding_filters(components: np.ndarray, path: Path, title: str = "") -> Path:
    """Fig. 7 left: the RGB patch-embedding filters' components, each tile min-max scaled."""
    k = components.shape[0]
    cols = min(7, k)
    rows = math.ceil(k / cols)
    fig = _figure(1.0 * cols, 1.0 * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.ravel()):
        ax.axis("off")
        if i >= k:
            continue
        tile = components[i]
        tile = np.moveaxis(tile, 0, -1) if tile.shape[0] in (1, 3) else tile.mean(0, keepdims=True).transpose(1, 2, 0)
        lo, hi = tile.min(), tile.max()
        tile = (tile - lo) / (hi - lo) if hi > lo else np.zeros_like(tile)
        ax.imshow(tile.squeeze(-1) if tile.shape[-1] == 1 else tile, cmap="gray", interpolation="nearest")
    fig.suptitle(title or f"RGB embedding filters (first {k} principal components)", fontsize=9)
    return _save(fig, path)


def plot_rollout(images: np.ndarray, maps: np.ndarray, path: Path, title: str = "") -> Path:
    """Fig. 6, a row per image (B, 3, H, W) in [-1, 1]: input, rollout over it, input weighted by it."""
    b = images.shape[0]
    fig = _figure(6.0, 2.0 * b + 0.5)
    axes = fig.subplots(b, 3, squeeze=False)
    for i in range(b):
        img = np.clip((np.moveaxis(images[i], 0, -1) + 1.0) / 2.0, 0.0, 1.0)  # (H, W, 3) in [0, 1]
        mask = _upsample(maps[i], img.shape[:2])
        mask = mask / max(mask.max(), 1e-12)
        axes[i, 0].imshow(img, interpolation="nearest")
        axes[i, 1].imshow(img, interpolation="nearest")
        axes[i, 1].imshow(mask, cmap="jet", alpha=0.5, interpolation="bilinear")
        axes[i, 2].imshow(img * mask[..., None], interpolation="nearest")
        for ax in axes[i]:
            ax.axis("off")
    for ax, label in zip(axes[0], ("Input", "Rollout", "Attention")):
        ax.set_title(label, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _upsample(grid_map: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    t = torch.as_tensor(grid_map, dtype=torch.float32)[None, None]
    return torch.nn.functional.interpolate(t, size=size, mode="bilinear", align_corners=False)[0, 0].numpy()


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


@dataclass(frozen=True)
class InspectConfig:
    """One ``type: inspect`` entry of an eval suite."""

    dataset: str = "digits"  # the shard folder <data_root>/<dataset>/<split>
    split: str = "test"
    num_images: int = 32  # the split's first (the paper: 128)
    num_rollout_images: int = 4  # rows of the Fig. 6 panel
    num_components: int = 28  # filter components drawn (fewer for a tiny model)
    batch_size: int = 16  # images per forward pass

    def __post_init__(self):
        for name in ("num_images", "num_rollout_images", "num_components", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.num_rollout_images > self.num_images:
            raise ValueError(f"num_rollout_images ({self.num_rollout_images}) must be ≤ num_images ({self.num_images})")


def _grid_of(num_patches: int, height: int, width: int) -> tuple[int, int]:
    """Patch grid (gh, gw) of ``num_patches`` square cells on an H×W input."""
    gh = round(math.sqrt(num_patches * height / width))
    if gh < 1 or num_patches % gh:
        raise ValueError(f"{num_patches} patch tokens do not tile a {height}x{width} image with square cells")
    return gh, num_patches // gh


@torch.no_grad()
def run_inspection(
    model,
    images: torch.Tensor,
    out_dir: Path,
    config: InspectConfig = InspectConfig(),
    label: str = "",
    prefix: str = "inspect",
) -> tuple[dict[str, float], list[Path]]:
    """Every analysis on ``images`` (B, 3, H, W) in [-1, 1] → (``<prefix>/...`` metrics, PNGs in ``out_dir``)."""
    out_dir = Path(out_dir)
    height, width = images.shape[-2:]
    num_prefix = model.num_prefix_tokens  # 1 with a class token, 0 for pool="gap"
    n = min(config.num_rollout_images, images.shape[0])
    sums, maps, grid, dist, keep, product = None, [], None, None, 0, None

    def reduce(layer: int, weights: torch.Tensor) -> np.ndarray:  # (b, heads, T, T) → (heads,), rollout of ``keep``
        nonlocal grid, dist, product
        if grid is None:
            grid = _grid_of(weights.shape[-1] - num_prefix, height, width)
            dist = patch_distances(grid, height / grid[0])
        if keep:
            product = _rollout_step(product, weights[:keep].float().cpu())  # the rollout so far
        return _attention_distance_sum(weights, dist, grid, num_prefix, layer)

    was_training = model.training
    model.eval()
    try:  # one layer of one batch's attention at a time: a batch's every layer is ~16 GB for ViT-L/16 at 384px
        for start in range(0, images.shape[0], config.batch_size):
            keep, product = max(0, n - start), None  # the batch's images in the rollout figure
            batch = model.forward_attention(images[start : start + config.batch_size], reduce=reduce)
            sums = np.stack(batch) if sums is None else sums + np.stack(batch)
            if keep:
                maps.append(_rollout_map(product, grid, num_prefix))
    finally:
        model.train(was_training)

    name = label or f"ViT {model.config.width}d x {model.config.depth}L"
    metrics: dict[str, float] = {}
    figures: list[Path] = []

    distances = sums / (images.shape[0] * dist.shape[0])  # (L, H)
    for i, row in enumerate(distances):
        metrics[f"{prefix}/mean_attention_distance/layer_{i + 1}"] = float(row.mean())
    metrics[f"{prefix}/mean_attention_distance/min_head"] = float(distances.min())
    metrics[f"{prefix}/mean_attention_distance/max_head"] = float(distances.max())
    uniform, title = float(dist.mean()), f"{name}: mean attention distance"
    figures.append(
        plot_attention_distance(distances, height, out_dir / "attention_distance.png", title, uniform=uniform)
    )
    np.save(out_dir / "attention_distance.npy", distances)

    pos = model.pos_embed.detach().float().cpu()  # (1, P+N, D), P prefix tokens
    pos_grid = _grid_of(pos.reshape(-1, pos.shape[-1]).shape[0] - num_prefix, height, width)
    sim = position_similarity(pos, pos_grid, num_prefix)
    metrics[f"{prefix}/pos_embed_similarity/neighbour"] = _neighbour_similarity(sim)
    figures.append(
        plot_position_similarity(sim, out_dir / "position_embedding_similarity.png", f"{name}: position embedding")
    )

    if getattr(model.config, "hybrid_stages", None) is None:  # a hybrid's 1x1 patches see features, not pixels
        components, ratio = embedding_filter_components(model.patch_embed.proj.weight, config.num_components)
        metrics[f"{prefix}/embedding_filters/explained_variance"] = float(ratio.sum())
        figures.append(plot_embedding_filters(components, out_dir / "embedding_filters.png"))

    rollout = out_dir / "attention_rollout.png"
    figures.append(plot_rollout(images[:n].float().cpu().numpy(), np.concatenate(maps), rollout, f"{name}: rollout"))
    return metrics, figures


def _neighbour_similarity(sim: np.ndarray) -> float:
    """Mean similarity of adjacent patches: high for a learned 2-D structure."""
    gh, gw = sim.shape[:2]
    values = [sim[r, c, r, c + 1] for r in range(gh) for c in range(gw - 1)]
    values += [sim[r, c, r + 1, c] for r in range(gh - 1) for c in range(gw)]
    return float(np.mean(values)) if values else float("nan")


def evaluate(ctx, config: InspectConfig) -> EvalOutput:
    """Suite entry: the figures and ``attention_distance.npy`` in ``<ctx.out_dir>/<entry>/``, the scalars as rows
    ``<entry>/...``; the entry is ``inspect`` unless it is named (or repeats in its suite)."""
    split = resolve_split(ctx.data_root, config.dataset, config.split)
    images, _, _ = load_images(split, image_size=ctx.model.config.image_size, limit=config.num_images)  # no crop
    images = images.to(ctx.device)
    label = f"step {ctx.step}" if ctx.step is not None else ""
    entry = ctx.entry or "inspect"
    out_dir = Path(ctx.out_dir) / entry
    metrics, figures = run_inspection(ctx.model, images, out_dir, config, label=label, prefix=entry)
    ctx.log(f"{entry}: {len(figures)} figures from {images.shape[0]} {config.dataset}/{config.split} images")
    rows = [ResultRow("inspect", config.dataset, key, value, count=images.shape[0]) for key, value in metrics.items()]
    return EvalOutput(rows=rows, artifacts=[*figures, out_dir / "attention_distance.npy"])
