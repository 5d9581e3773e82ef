"""Few-shot linear regression on frozen features (ViT paper §4.1, big_vision `fewshot_lsr.py`; docs/reference.md §4)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evals.evaluator import EvalOutput, ResultRow
from evals.features import check_sizes, resolve_split, suite_features

BIAS_CONSTANT = 100.0  # large, so the l2 penalty barely shrinks the bias weight
STD_EPS = 1e-5  # added to the std, not the variance (big_vision)
L2_SWEEP = tuple(2.0**e for e in range(-10, 20))  # 2^-10 .. 2^19, the paper's sweep variant


def _as_features(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (num_examples, feature_dim); got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise ValueError(f"{name} must hold real numbers; got dtype {x.dtype}")
    x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains NaN or inf; check the model's features (a diverged checkpoint?)")
    return x


def _as_labels(y, name: str, num_examples: int) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of integer class ids; got shape {y.shape}")
    if len(y) != num_examples:
        raise ValueError(f"{name} has {len(y)} labels but its features have {num_examples} rows; they must match")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        if not np.issubdtype(y.dtype, np.floating) or not np.all(np.equal(np.mod(y, 1), 0)):
            raise ValueError(f"{name} must hold integer class ids; got dtype {y.dtype} with non-integer values")
    y = y.astype(np.int64)
    if y.size and y.min() < 0:
        raise ValueError(f"{name} contains the negative label {int(y.min())}; class ids must be 0..K-1")
    return y


def resolve_num_classes(train_y: np.ndarray, test_y: np.ndarray, num_classes: int | None) -> int:
    """K: as given, else ``max label + 1`` over both splits; a label >= a given K raises."""
    largest = max(int(train_y.max(initial=-1)), int(test_y.max(initial=-1)))
    if num_classes is None:
        return largest + 1
    if int(num_classes) < 1:
        raise ValueError(f"num_classes must be >= 1; got {num_classes}")
    if largest >= num_classes:
        raise ValueError(
            f"label {largest} exceeds the declared num_classes={num_classes} (valid ids are 0..{num_classes - 1}); "
            "fix the dataset's labels or its declared class count"
        )
    return int(num_classes)


@dataclass(frozen=True)
class RidgeSolver:
    """One few-shot subset decomposed once; each l2 then costs one matmul: ``W = lhs · diag(1 / (eigs + l2)) · rhs``
    (N ≥ D: eigh of XᵀX; D > N: of XXᵀ, by push-through)."""

    mean: np.ndarray  # (1, D-1) mean of the subset's raw features
    std: np.ndarray  # (1, D-1) population std + STD_EPS
    eigs: np.ndarray  # (M,)  M = min(N, D)
    lhs: np.ndarray  # (D, M)
    rhs: np.ndarray  # (M, K)

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, num_classes: int) -> RidgeSolver:
        mean = x.mean(axis=0, keepdims=True)
        std = x.std(axis=0, keepdims=True) + STD_EPS
        design = _pad_bias((x - mean) / std)  # (N, D)
        targets = 2.0 * np.eye(num_classes, dtype=np.float64)[y] - 1.0  # (N, K)
        num_points, dim = design.shape
        if num_points >= dim:
            eigs, q = np.linalg.eigh(design.T @ design)
            lhs, rhs = q, q.T @ (design.T @ targets)
        else:
            eigs, q = np.linalg.eigh(design @ design.T)
            lhs, rhs = design.T @ q, q.T @ targets
        return cls(mean=mean, std=std, eigs=eigs, lhs=lhs, rhs=rhs)

    def weights(self, l2_reg: float) -> np.ndarray:
        """(D, K)."""
        return (self.lhs / (self.eigs + l2_reg)[None, :]) @ self.rhs

    def predict(self, test_x: np.ndarray, l2_reg: float) -> np.ndarray:
        """(N_test,) class ids."""
        design = _pad_bias((test_x - self.mean) / self.std)  # (N_test, D)
        return np.argmax(design @ self.weights(l2_reg), axis=1)

    def accuracy(self, test_x: np.ndarray, test_y: np.ndarray, l2_reg: float) -> float:
        return float(np.mean(self.predict(test_x, l2_reg) == test_y))


def _pad_bias(x: np.ndarray) -> np.ndarray:
    return np.concatenate([x, np.full((x.shape[0], 1), BIAS_CONSTANT, dtype=x.dtype)], axis=1)


def _check_l2(l2_reg: float) -> float:
    l2 = float(l2_reg)
    if not np.isfinite(l2) or l2 <= 0:
        raise ValueError(f"l2_reg must be a positive finite number (the paper uses 1024); got {l2_reg}")
    return l2


def fit_ridge(train_x, train_y, *, test_y=None, num_classes: int | None = None) -> tuple[RidgeSolver, int]:
    """Validate and decompose a few-shot subset: ``(solver, K)``."""
    x = _as_features(train_x, "train_x")
    y = _as_labels(train_y, "train_y", len(x))
    if len(x) == 0:
        raise ValueError("train_x is empty: few-shot regression needs at least one training example")
    k = resolve_num_classes(y, np.zeros(0, np.int64) if test_y is None else test_y, num_classes)
    return RidgeSolver.fit(x, y, k), k


def fewshot_accuracy(train_x, train_y, test_x, test_y, l2_reg: float = 1024.0, *, num_classes: int | None = None):
    """Top-1 accuracy (fraction) of the few-shot ridge regression on features; K: `resolve_num_classes`."""
    l2 = _check_l2(l2_reg)
    test_features = _as_features(test_x, "test_x")
    labels = _as_labels(test_y, "test_y", len(test_features))
    if len(test_features) == 0:
        raise ValueError("test_x is empty: there is nothing to measure accuracy on")
    solver, _ = fit_ridge(train_x, train_y, test_y=labels, num_classes=num_classes)
    if test_features.shape[1] != solver.mean.shape[1]:
        raise ValueError(
            f"test_x has {test_features.shape[1]} features but train_x has {solver.mean.shape[1]}; "
            "both must come from the same representation"
        )
    return solver.accuracy(test_features, labels, l2)


def sample_fewshot_indices(labels, shots: list[int] | tuple[int, ...], seed: int, num_classes: int):
    """Class-balanced subsets ``{shots: indices}``, nested: a k-shot subset takes the first k of a seeded permutation
    per class."""
    labels = np.asarray(labels)
    for k in shots:
        if int(k) != k or k < 1:
            raise ValueError(f"shots must be positive integers (e.g. 1, 5, 10, 25); got {k}")
    if labels.size and int(labels.max()) >= num_classes:
        raise ValueError(
            f"label {int(labels.max())} exceeds the declared num_classes={num_classes}; fix the dataset's labels "
            "or its declared class count"
        )
    rng = np.random.default_rng(seed)
    per_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    empty = [c for c, idx in enumerate(per_class) if not len(idx)]
    if empty:  # no shot count samples these
        listed = ", ".join(map(str, empty[:8])) + (", ..." if len(empty) > 8 else "")
        raise ValueError(
            f"{len(empty)} of the {num_classes} declared classes have no training examples (class {listed}); "
            "use a train split that holds every class, or remap the labels and the declared class count "
            "(dataset.json num_classes) to the classes present"
        )
    most = max(shots)
    short = [(c, len(idx)) for c, idx in enumerate(per_class) if len(idx) < most]
    if short:
        listed = ", ".join(f"class {c}: {n}" for c, n in short[:8])
        raise ValueError(
            f"{most}-shot needs {most} training examples per class but {len(short)} class(es) have fewer "
            f"({listed}{', ...' if len(short) > 8 else ''}); lower the shots or use a larger train split"
        )
    return {int(k): np.concatenate([idx[:k] for idx in per_class]) for k in shots}


def choose_l2_by_mean_rank(accuracy: dict[str, dict[float, float]]) -> tuple[float, dict[float, float]]:
    """``(l2, {l2: mean rank})`` from ``{dataset: {l2: accuracy}}``: the lowest mean rank (ties: the smaller l2)."""
    from scipy.stats import rankdata  # heavy: only the l2 sweep needs it

    if not accuracy:
        raise ValueError("choosing l2 by mean rank needs at least one dataset")
    grids = {tuple(sorted(per_l2)) for per_l2 in accuracy.values()}
    if len(grids) != 1:
        raise ValueError("every dataset must be evaluated on the same l2 grid to rank l2 values across datasets")
    grid = list(grids.pop())
    ranks = np.stack([rankdata([-per_l2[l2] for l2 in grid]) for per_l2 in accuracy.values()])  # (datasets, L)
    mean_rank = ranks.mean(axis=0)
    best = grid[int(np.argmin(mean_rank))]  # the first (smallest l2) among ties
    return best, dict(zip(grid, mean_rank.tolist()))


@dataclass(frozen=True)
class FewshotOptions:
    """A ``type: fewshot`` suite entry (defaults: the paper's)."""

    datasets: tuple[str, ...] = ("digits",)  # folders under the data root, each with train/ and test/
    shots: tuple[int, ...] = (1, 5, 10, 25)  # images per class; 10-shot is the headline number
    seeds: tuple[int, ...] = (0, 1, 2)  # one subset per seed, reported as mean ± std
    l2_reg: float = 1024.0
    l2_sweep: bool = False  # L2_SWEEP, one l2 per shot count by mean rank
    train_split: str = "train"
    test_split: str = "test"
    image_size: int | None = None  # None: the model's
    resize_size: int | None = None  # square resize before the centre crop; None: no crop
    batch_size: int = 256

    def __post_init__(self):
        if not self.datasets:
            raise ValueError("'datasets' is empty; name at least one dataset folder (e.g. [digits])")
        if not self.shots or any(int(k) != k or k < 1 for k in self.shots):
            raise ValueError(f"shots must be a non-empty list of positive integers; got {list(self.shots)}")
        if not self.seeds:
            raise ValueError("'seeds' is empty; use e.g. [0, 1, 2]")
        for name in ("datasets", "shots", "seeds"):  # a repeat is counted twice: a seed in the ± as if independent
            values = list(getattr(self, name))
            if len(set(values)) < len(values):
                raise ValueError(
                    f"{name} {values} repeats {next(v for v in values if values.count(v) > 1)!r}; list each once"
                )
        check_sizes(self)
        if not self.l2_sweep:
            _check_l2(self.l2_reg)


def fewshot_table(features: dict, shots, seeds, l2_grid) -> dict:
    """``{dataset: {shots: {l2: [accuracy per seed]}}}`` from ``{dataset: (train_x, train_y, test_x, test_y, K)}``."""
    table = {}
    for name, (train_x, train_y, test_x, test_y, k) in features.items():
        train_x, test_x = train_x.astype(np.float64), test_x.astype(np.float64)
        per_shot = {int(s): {float(l2): [] for l2 in l2_grid} for s in shots}
        for seed in seeds:
            for s, idx in sample_fewshot_indices(train_y, shots, seed, k).items():
                solver = RidgeSolver.fit(train_x[idx], train_y[idx], k)
                for l2 in l2_grid:
                    per_shot[s][float(l2)].append(solver.accuracy(test_x, test_y, l2))
        table[name] = per_shot
    return table


def evaluate(ctx, opts: FewshotOptions) -> EvalOutput:
    """Suite entry: accuracy (fraction) per dataset and shot, and the mean over datasets."""
    features = {}
    for name in opts.datasets:
        train_x, train_y, info = suite_features(ctx, resolve_split(ctx.data_root, name, opts.train_split), opts)
        test_x, test_y, test_info = suite_features(ctx, resolve_split(ctx.data_root, name, opts.test_split), opts)
        if test_info.num_classes != info.num_classes:
            raise ValueError(
                f"{name}: train declares {info.num_classes} classes but test declares "
                f"{test_info.num_classes}; both splits must share one label space"
            )
        features[name] = (train_x, train_y, test_x, test_y, info.num_classes)
        ctx.log(f"fewshot: {name} features train {train_x.shape} test {test_x.shape}, {info.num_classes} classes")

    l2_grid = L2_SWEEP if opts.l2_sweep else (float(opts.l2_reg),)
    table = fewshot_table(features, opts.shots, opts.seeds, l2_grid)
    out = EvalOutput()
    for shots in opts.shots:
        l2 = float(opts.l2_reg)
        if opts.l2_sweep:
            seed_means = {name: {g: float(np.mean(v)) for g, v in table[name][shots].items()} for name in table}
            l2, _ = choose_l2_by_mean_rank(seed_means)
            detail = f"l2 chosen by mean rank over {len(table)} dataset(s), on test accuracy"
            out.rows.append(ResultRow("fewshot", "*", f"fewshot/l2/{shots}shot", l2, count=len(table), detail=detail))
        means = []
        for name in table:
            accs = np.asarray(table[name][shots][l2])
            mean, std = float(accs.mean()), float(accs.std(ddof=1)) if len(accs) > 1 else float("nan")
            means.append(mean)
            out.rows.append(
                ResultRow("fewshot", name, f"fewshot/{name}/{shots}shot", mean, std, len(accs), detail=f"l2={l2:g}")
            )
        detail, mean = f"mean over {len(means)} dataset(s): {', '.join(table)}", float(np.mean(means))
        out.rows.append(
            ResultRow("fewshot", "mean", f"fewshot/mean/{shots}shot", mean, count=len(means), detail=detail)
        )
    return out
