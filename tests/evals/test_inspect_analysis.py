"""evals.inspection pure functions against hand-computed values (paper §4.5 definitions, docs/reference.md §4)."""

import math

import numpy as np
import pytest
import torch

from evals import inspection as insp


def _with_class_token(patch_attn: np.ndarray, class_key_weight: float = 0.0) -> np.ndarray:
    """Embed an (H, N, N) patch attention into (1, H, 1+N, 1+N), giving each patch query ``class_key_weight`` on
    the class token and scaling its patch weights to keep the row a distribution; the class query looks at the
    last patch only (it must not influence the distance)."""
    h, n, _ = patch_attn.shape
    a = np.zeros((1, h, n + 1, n + 1))
    a[0, :, 1:, 1:] = patch_attn * (1.0 - class_key_weight)
    a[0, :, 1:, 0] = class_key_weight
    a[0, :, 0, -1] = 1.0
    return a


def test_patch_distances_are_pixel_distances_between_centres():
    d = insp.patch_distances((2, 2), 16)
    s = 16 * math.sqrt(2)
    np.testing.assert_allclose(d, [[0, 16, 16, s], [16, 0, s, 16], [16, s, 0, 16], [s, 16, 16, 0]])
    with pytest.raises(ValueError, match="cell_pixels"):
        insp.patch_distances((2, 2), 0)


def test_mean_attention_distance_of_hand_built_heads_equals_analytic_value():
    n = 4  # a 2x2 grid of 16-pixel patches
    self_only = np.eye(n)
    opposite = np.fliplr(np.eye(n))  # each patch looks at the diagonally opposite corner
    uniform = np.full((n, n), 1.0 / n)
    attn = _with_class_token(np.stack([self_only, opposite, uniform]), class_key_weight=0.3)
    dist = insp.mean_attention_distance([attn, attn[:, ::-1]], grid=(2, 2), cell_pixels=16)
    assert dist.shape == (2, 3)
    expected = [0.0, 16 * math.sqrt(2), (0 + 16 + 16 + 16 * math.sqrt(2)) / 4]
    np.testing.assert_allclose(dist[0], expected, rtol=1e-12)
    np.testing.assert_allclose(dist[1], expected[::-1], rtol=1e-12)


def test_attention_to_four_neighbours_is_one_cell_away_whatever_the_weights():
    gh, gw, cell = 4, 5, 8
    n = gh * gw
    rng = np.random.default_rng(0)
    patch = np.zeros((2, n, n))
    for r in range(gh):
        for c in range(gw):
            nbrs = [
                (r + dr, c + dc)
                for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))
                if 0 <= r + dr < gh and 0 <= c + dc < gw
            ]
            for h in range(2):
                w = rng.random(len(nbrs))
                for (rr, cc), wi in zip(nbrs, w / w.sum()):
                    patch[h, r * gw + c, rr * gw + cc] = wi
    attn = np.concatenate([_with_class_token(patch, 0.5)] * 3)  # three identical images
    dist = insp.mean_attention_distance([torch.from_numpy(attn)], grid=(gh, gw), cell_pixels=cell)
    np.testing.assert_allclose(dist, [[cell, cell]], rtol=1e-12)


def test_mean_attention_distance_rejects_a_wrong_grid():
    attn = np.full((1, 2, 5, 5), 0.2)
    with pytest.raises(ValueError, match="grid"):
        insp.mean_attention_distance([attn], grid=(3, 3), cell_pixels=4)


def test_rollout_of_identity_attention_is_the_identity():
    t = 10  # class token + 3x3 grid
    eye = torch.eye(t).expand(2, 4, t, t)  # (B, heads, T, T)
    rollout = insp.attention_rollout([eye, eye, eye])
    torch.testing.assert_close(rollout, torch.eye(t, dtype=torch.float64).expand(2, t, t))


def test_rollout_multiplies_layers_bottom_up_with_the_residual():
    a1 = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])  # every token reads token 0
    a2 = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]]]])  # every token reads token 1
    # (A+I) row-normalised: Ā1 = [[1, 0], [.5, .5]], Ā2 = [[.5, .5], [0, 1]]; R = Ā2 · Ā1.
    expected = torch.tensor([[[0.75, 0.25], [0.5, 0.5]]], dtype=torch.float64)
    torch.testing.assert_close(insp.attention_rollout([a1, a2]), expected)
    assert torch.allclose(insp.attention_rollout([a1, a2]).sum(-1), torch.ones(1, 2, dtype=torch.float64))


def test_rollout_of_uniform_patch_attention_is_uniform_over_the_grid():
    t, grid = 1 + 6, (2, 3)
    a = torch.zeros(1, 2, t, t)
    a[..., 1:] = 1.0 / 6  # every token spreads over all patches, none on the class token
    maps = insp.rollout_maps([a, a, a, a], grid)
    assert maps.shape == (1, 2, 3)
    np.testing.assert_allclose(maps, np.full((1, 2, 3), 1 / 6), rtol=1e-12)


def test_position_similarity_with_itself_is_one():
    rng = np.random.default_rng(1)
    pos = torch.from_numpy(rng.normal(size=(1, 1 + 12, 16)))
    sim = insp.position_similarity(pos, (3, 4))
    assert sim.shape == (3, 4, 3, 4)
    flat = sim.reshape(12, 12)
    np.testing.assert_allclose(np.diag(flat), 1.0, rtol=1e-12)
    np.testing.assert_allclose(flat, flat.T)
    assert flat.max() <= 1 + 1e-12 and flat.min() >= -1 - 1e-12
    # Orthogonal embeddings are dissimilar to every other patch.
    onehot = np.concatenate([np.ones((1, 12)), np.eye(12)])
    np.testing.assert_allclose(insp.position_similarity(onehot, (3, 4)).reshape(12, 12), np.eye(12), atol=1e-12)


def test_embedding_filter_components_recover_the_planted_directions():
    rng = np.random.default_rng(2)
    basis, _ = np.linalg.qr(rng.normal(size=(3 * 4 * 4, 2)))  # two orthonormal directions in pixel space
    raw = rng.normal(size=(200, 2))
    # Centred, uncorrelated coefficients: the planted directions are then exactly the principal axes.
    coef, _ = np.linalg.qr(raw - raw.mean(0))
    coef = coef * np.array([5.0, 1.0])  # the first explains far more variance
    kernel = (coef @ basis.T).reshape(200, 3, 4, 4)
    comps, ratio = insp.embedding_filter_components(kernel, num_components=28)
    assert comps.shape[1:] == (3, 4, 4) and comps.shape[0] == 28
    np.testing.assert_allclose(abs(comps[0].ravel() @ basis[:, 0]), 1.0, atol=1e-6)
    np.testing.assert_allclose(abs(comps[1].ravel() @ basis[:, 1]), 1.0, atol=1e-6)
    np.testing.assert_allclose(ratio[:2].sum(), 1.0, atol=1e-9)
    small, _ = insp.embedding_filter_components(kernel[:5], num_components=28)
    assert small.shape[0] == 5  # fewer filters than requested components


def test_inspect_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_images"):
        insp.InspectConfig(num_images=0)
    with pytest.raises(ValueError, match="num_rollout_images"):
        insp.InspectConfig(num_images=2, num_rollout_images=3)


def _nonblank_png(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.05, f"{path} looks blank"


def test_figures_from_hand_made_arrays(tmp_path):
    rng = np.random.default_rng(3)
    paths = [
        insp.plot_attention_distance(rng.random((4, 3)) * 20, 32, tmp_path / "d.png"),
        insp.plot_position_similarity(insp.position_similarity(rng.normal(size=(17, 8)), (4, 4)), tmp_path / "p.png"),
        insp.plot_embedding_filters(rng.normal(size=(10, 3, 4, 4)), tmp_path / "f.png"),
        insp.plot_rollout(rng.uniform(-1, 1, size=(2, 3, 32, 32)), rng.random((2, 8, 8)), tmp_path / "r.png"),
    ]
    for p in paths:
        _nonblank_png(p)
