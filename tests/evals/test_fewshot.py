"""Few-shot ridge regression: parity with a direct normal-equation solve, properties, sampling, bad input."""

import numpy as np
import pytest

from evals.fewshot import (
    L2_SWEEP,
    choose_l2_by_mean_rank,
    fewshot_accuracy,
    sample_fewshot_indices,
)


def direct_fewshot(train_x, train_y, test_x, test_y, l2, k):
    """The protocol written the obvious way: (XᵀX + l2 I) W = XᵀY with numpy's solver, no eigendecomposition."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-5
    x = np.hstack([(train_x - mean) / std, np.full((len(train_x), 1), 100.0)])
    t = np.hstack([(test_x - mean) / std, np.full((len(test_x), 1), 100.0)])
    y = 2.0 * np.eye(k)[train_y] - 1.0
    w = np.linalg.solve(x.T @ x + l2 * np.eye(x.shape[1]), x.T @ y)
    return float(np.mean(np.argmax(t @ w, 1) == test_y))


def synthetic(rng, n_train, n_test, dim, k, noise):
    centres = rng.normal(size=(k, dim)) * 3 + rng.normal(size=dim) * 5  # offset: standardisation matters
    train_y, test_y = rng.integers(0, k, n_train), rng.integers(0, k, n_test)
    scale = rng.uniform(0.1, 10, size=dim)  # uneven feature scales: std division matters
    train_x = (centres[train_y] + rng.normal(size=(n_train, dim)) * noise) * scale
    test_x = (centres[test_y] + rng.normal(size=(n_test, dim)) * noise) * scale
    return train_x, train_y, test_x, test_y


@pytest.mark.parametrize(
    "n_train,dim,k,l2",
    [(50, 8, 5, 1024.0), (40, 64, 10, 1024.0), (200, 16, 4, 1.0), (30, 100, 3, 2.0**-10), (300, 32, 7, 2.0**19)],
)
def test_matches_direct_normal_equations(n_train, dim, k, l2):
    # Both branches (N >= D: eigh of XᵀX; D > N: eigh of XXᵀ) and the ends of the sweep grid.
    rng = np.random.default_rng(n_train + dim)
    tr_x, tr_y, te_x, te_y = synthetic(rng, n_train, 400, dim, k, noise=1.5 * np.sqrt(dim))
    got = fewshot_accuracy(tr_x, tr_y, te_x, te_y, l2_reg=l2, num_classes=k)
    want = direct_fewshot(tr_x, tr_y, te_x, te_y, l2, k)
    assert got == pytest.approx(want, abs=1.5 / 400)  # at most one near-tie argmax may flip in float64
    assert 0.0 < got < 1.0  # noisy enough that the check is not trivially saturated


def test_default_num_classes_is_max_label_plus_one():
    rng = np.random.default_rng(0)
    tr_x, tr_y, te_x, te_y = synthetic(rng, 60, 200, 12, 6, noise=3.0)
    assert fewshot_accuracy(tr_x, tr_y, te_x, te_y) == fewshot_accuracy(tr_x, tr_y, te_x, te_y, num_classes=6)
    assert fewshot_accuracy(tr_x, tr_y, te_x, te_y) == pytest.approx(direct_fewshot(tr_x, tr_y, te_x, te_y, 1024, 6))


def test_perfectly_separable_is_one_and_chance_is_low():
    # Each class lights up its own feature (plus distractor noise): regression to ±1 targets separates them.
    rng = np.random.default_rng(1)
    tr_y, te_y = np.arange(100) % 10, rng.integers(0, 10, 300)
    tr_x = np.hstack([np.eye(10)[tr_y] * 5, rng.normal(size=(100, 6))]) + rng.normal(size=(100, 16)) * 0.05
    te_x = np.hstack([np.eye(10)[te_y] * 5, rng.normal(size=(300, 6))]) + rng.normal(size=(300, 16)) * 0.05
    assert fewshot_accuracy(tr_x, tr_y, te_x, te_y) == 1.0
    noise_x = rng.normal(size=(300, 20))
    assert fewshot_accuracy(rng.normal(size=(100, 20)), tr_y, noise_x, te_y) < 0.3


def test_invariant_to_feature_scale_and_shift():
    rng = np.random.default_rng(2)
    tr_x, tr_y, te_x, te_y = synthetic(rng, 80, 300, 10, 4, noise=3.0)
    a = fewshot_accuracy(tr_x, tr_y, te_x, te_y)
    assert fewshot_accuracy(tr_x * 7 + 3, tr_y, te_x * 7 + 3, te_y) == pytest.approx(a, abs=1 / 300)


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(20, 4)), np.arange(20) % 4
    with pytest.raises(ValueError, match="exceeds the declared num_classes=3"):
        fewshot_accuracy(x, y, x, y, num_classes=3)
    with pytest.raises(ValueError, match="l2_reg must be a positive"):
        fewshot_accuracy(x, y, x, y, l2_reg=0)
    with pytest.raises(ValueError, match="has 19 labels"):
        fewshot_accuracy(x, y[:-1], x, y)
    with pytest.raises(ValueError, match="test_x has 3 features"):
        fewshot_accuracy(x, y, x[:, :3], y)
    with pytest.raises(ValueError, match="NaN"):
        fewshot_accuracy(np.full((20, 4), np.nan), y, x, y)
    with pytest.raises(ValueError, match="negative label"):
        fewshot_accuracy(x, y - 1, x, y)
    with pytest.raises(ValueError, match="integer class ids"):
        fewshot_accuracy(x, y + 0.5, x, y)


def test_sampling_is_balanced_nested_and_seeded():
    labels = np.repeat(np.arange(5), 30)
    np.random.default_rng(0).shuffle(labels)
    subsets = sample_fewshot_indices(labels, [1, 5, 10], seed=0, num_classes=5)
    for k, idx in subsets.items():
        assert np.bincount(labels[idx], minlength=5).tolist() == [k] * 5
    per_class_5 = {c: set(subsets[5][labels[subsets[5]] == c]) for c in range(5)}
    assert all(set(subsets[1][labels[subsets[1]] == c]) <= per_class_5[c] for c in range(5))  # nested
    again = sample_fewshot_indices(labels, [1, 5, 10], seed=0, num_classes=5)
    assert all(np.array_equal(subsets[k], again[k]) for k in subsets)
    other = sample_fewshot_indices(labels, [10], seed=1, num_classes=5)
    assert not np.array_equal(other[10], subsets[10])


def test_sampling_bad_shots():
    labels = np.array([0] * 10 + [1] * 3)
    with pytest.raises(ValueError, match="5-shot needs 5 training examples per class.*class 1: 3"):
        sample_fewshot_indices(labels, [1, 5], seed=0, num_classes=2)
    with pytest.raises(ValueError, match="positive integers"):
        sample_fewshot_indices(labels, [0], seed=0, num_classes=2)
    with pytest.raises(ValueError, match="exceeds the declared num_classes=1"):
        sample_fewshot_indices(labels, [1], seed=0, num_classes=1)


EMPTY = r"^1 of the 4 declared classes have no training examples \(class 2\)"


def test_a_class_without_train_images_names_the_split_not_the_shots():
    """No shot count samples a class the split lacks: the fix is the split or its declared classes."""
    labels = np.array([0, 0, 1, 1, 3, 3, 3])
    for shots in ([1], [2, 3]):
        with pytest.raises(ValueError, match=EMPTY) as e:
            sample_fewshot_indices(labels, shots, seed=0, num_classes=4)
        assert "lower the shots" not in str(e.value) and "every class" in str(e.value)


def test_l2_choice_by_mean_rank():
    acc = {
        "a": {1.0: 0.5, 2.0: 0.7, 4.0: 0.6},
        "b": {1.0: 0.9, 2.0: 0.8, 4.0: 0.85},
        "c": {1.0: 0.2, 2.0: 0.4, 4.0: 0.3},
    }
    best, ranks = choose_l2_by_mean_rank(acc)
    assert best == 2.0  # ranks 1, 3, 1 → mean 5/3 beats 4.0 (2, 2, 2) and 1.0 (3, 1, 3)
    assert ranks == pytest.approx({1.0: 7 / 3, 2.0: 5 / 3, 4.0: 2.0})
    assert len(L2_SWEEP) == 30 and L2_SWEEP[0] == 2.0**-10 and L2_SWEEP[-1] == 2.0**19
