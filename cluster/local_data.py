"""The built-in datasets a run reads and their folders on the `local` profile: which (`builtin_requirements`), whether
each is complete (`check_local_data`), and generating the absent ones (`prepare_local_data`)."""

from __future__ import annotations

import time
from pathlib import Path

from data_pipeline.builtin import sets as builtin
from data_pipeline.paths import is_remote, resolve_path
from evals.suites import SuiteConfig
from evals.vtab import BENCHMARKS


def _suite_datasets(suite: SuiteConfig) -> list[tuple[str, str | None]]:
    """(name, its data root or None) of each built-in dataset the suite reads."""
    found = []
    for spec in suite.evaluators:
        o = spec.options
        names = list(getattr(o, "datasets", None) or ()) + list(getattr(o, "tasks", None) or ())
        if isinstance(getattr(o, "dataset", None), str):
            names.append(o.dataset)
        if getattr(o, "benchmark", None) == "ci" and o.tasks is None:
            names += list(BENCHMARKS["ci"])
        found += [
            (n, getattr(o, "data_root", None)) for n in names if isinstance(n, str) and n in builtin.BUILTIN_NAMES
        ]
    return found


def builtin_requirements(config, suite: SuiteConfig | None) -> list[tuple[str, Path, dict]]:
    """(name, root, options) of each local built-in folder ``root/<name>`` the run reads, eval sets at their
    defaults; none under an ``s3://``/``gs://`` root."""
    found: list[tuple[str, Path, dict]] = []
    if config.data.generates_builtin:
        name = builtin.ALIASES.get(config.data.builtin, config.data.builtin)
        found.append((name, config.data.builtin_root, dict(config.data.builtin_options)))
    if suite is not None:
        for name, root in _suite_datasets(suite):
            where = root or config.evals.data_root
            if not is_remote(where):  # a bucket is read as it is
                found.append((name, resolve_path(where), {}))
    unique = {}
    for name, root, options in found:
        unique.setdefault((name, root, tuple(builtin.settings(name, **options).items())), (name, root, options))
    return list(unique.values())


def check_local_data(config, suite: SuiteConfig | None) -> dict[Path, bool]:
    """Each folder of `builtin_requirements` -> whether it is complete; generates nothing. ValueError when one was
    generated at other settings, or is read at two settings."""
    needs = builtin_requirements(config, suite)
    wanted: dict[Path, dict] = {}
    for name, root, options in needs:
        this = builtin.settings(name, **options)
        first = wanted.setdefault(root / name, this)
        if this != first:
            differ = ", ".join(f"{k}={first[k]} / {v}" for k, v in this.items() if first[k] != v)
            raise ValueError(
                f"{root / name} is read at two settings ({differ}): by the training set (data.builtin_options) and "
                "by the eval suite (the set's defaults); train on the defaults or set evals.data_root to another root"
            )
    complete = {}
    for name, root, options in needs:
        try:
            complete[root / name] = builtin.check_folder(name, root, **options)
        except builtin.OtherSettings as error:  # the training set's own fixes, when it is the training set
            trains = config.data.generates_builtin and error.folder == config.data.builtin_root / name
            raise config.data.other_settings(error) if trains else error from None
    return complete


def prepare_local_data(config, suite: SuiteConfig | None) -> None:
    """Generate the absent folders of `builtin_requirements`."""
    for name, root, options in builtin_requirements(config, suite):
        t0 = time.monotonic()
        folder = builtin.ensure(name, root, **options)
        print(f"data: {name} ready in {folder} ({time.monotonic() - t0:.1f} s)", flush=True)
