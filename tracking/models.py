"""A run's model in MLflow: an HF ViT folder (`pretrain.weights.export.save_hf`) logged as an MLflow model of the run.

Why a pyfunc over the HF folder rather than MLflow's transformers flavour: that flavour logs a *pipeline* (image in,
top labels out), needs torchvision for the image processor and does not give the logits back; the pyfunc here
(`tracking/hf_pyfunc.py`, stored as source code, nothing pickled) loads the folder with transformers alone, offline,
and returns exactly the logits vitscale's own forward gives. The folder is the model's artifact ``hf``, so
`mlflow.artifacts.download_artifacts(f"{uri}/artifacts/hf")` hands back a plain `from_pretrained` folder too.

What is logged: the model (name ``model``) linked to the run at the checkpoint's step, with a signature (pixels
(-1, C, S, S) float32 in [-1, 1] → logits (-1, num_classes), or the features (-1, D) of a headless model), an input
example, pinned pip requirements, tags ``vitscale.step``, ``vitscale.source`` and ``vitscale.eval.<key>`` for each
eval mean the run holds at that step (``fewshot/mean/10shot``, ``vtab/mean``, ...); the run gets the tags
``vitscale.model_uri`` and ``vitscale.model_step`` (`make compare` shows them) unless it already names a model of a
later step.

Callers: ``python -m pretrain.weights export SOURCE OUT --mlflow-run ID`` (any checkpoint, on request) and
`cluster.driver.record.finish_job` (the newest checkpoint at the end of a job, failure-tolerant). ``mlflow`` is imported
inside the functions (seconds to import): this module is imported by the weights CLI.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
from pathlib import Path
from typing import Any

from tracking import keys
from tracking.tracker import default_tracking_uri

MODEL_NAME = "model"
HF_ARTIFACT = "hf"  # the folder's name among the model's artifacts
CODE_FILE = Path(__file__).with_name("hf_pyfunc.py")
_REQUIREMENTS = ("torch", "transformers", "numpy", "safetensors")
_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
_URI_VARIABLE = "MLFLOW_TRACKING_URI"


def log_hf_model(
    hf_dir: str | Path, run_id: str, tracking_uri: str | None = None, *, step: int | None, source: Any = None
) -> str:
    """Log the HF ViT folder ``hf_dir`` as an MLflow model of run ``run_id`` at checkpoint ``step``; returns its URI
    (``models:/m-…``). ValueError naming the fix when the run is not in the store, the folder is not an HF ViT
    export, ``step`` is None (only a training checkpoint has a place in a run) or transformers is missing."""
    import mlflow  # heavy: only when a model is logged
    from mlflow.exceptions import MlflowException

    hf_dir = Path(hf_dir)
    if step is None:
        raise ValueError(
            f"{source or hf_dir} is no training checkpoint: only a checkpoint (or a run folder: its "
            "newest one) is logged into a run, at its step"
        )
    _require_transformers()
    uri = tracking_uri or default_tracking_uri()
    client = mlflow.MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ValueError(
            f"MLflow run {run_id!r} is not in {uri}; pass a run id `make ui` lists, and --tracking-uri "
            "for a store other than the project's"
        ) from None
    spec, example = signature(hf_dir), input_example(hf_dir)  # a folder that is no HF ViT export is refused here
    means = eval_means(client, run_id, step)
    tags = {keys.MODEL_TAG_STEP: str(step), keys.MODEL_TAG_SOURCE: str(source or hf_dir)}
    tags |= {keys.MODEL_TAG_EVAL_PREFIX + key: repr(value) for key, value in means.items()}
    # Created here, in the run's experiment: MLflow's log_model would file it under the process's active experiment
    # (the default one, whose artifacts go to ./mlruns of whatever folder the process runs in).
    model = client.create_logged_model(
        run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id, tags=tags, params=dict(run.data.params)
    )
    with _tracking_uri(uri):
        info = mlflow.models.Model.log(
            artifact_path=None,
            name=MODEL_NAME,
            flavor=mlflow.pyfunc,
            flavor_name="pyfunc.ModelFromCode",
            run_id=run_id,
            step=step,
            model_id=model.model_id,
            python_model=str(CODE_FILE),
            artifacts={HF_ARTIFACT: str(hf_dir)},
            signature=spec,
            input_example=example,
            pip_requirements=requirements(),
            metadata={"vitscale": {"step": step, "source": str(source or hf_dir), "eval_means": means}},
        )
    _tag_run(client, run_id, info.model_uri, step)
    return info.model_uri


def _require_transformers() -> None:
    try:
        importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            "transformers is not installed: the logged model loads through it (and MLflow checks the "
            "input example by loading it); pip install 'transformers>=4.45,<6'"
        ) from None


@contextlib.contextmanager
def _tracking_uri(uri: str):
    """MLflow's model logging reads the process-wide tracking URI: set it for the call, then put everything back —
    MLflow's own setting and the ``MLFLOW_TRACKING_URI`` variable it rewrites on the way (which
    `tracking.tracker.default_tracking_uri` reads). Its progress bars are off meanwhile (the input-example check
    downloads the model back): a job's log stays readable."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri  # restores MLflow's setting as it was

    saved = {name: os.environ.get(name) for name in (_PROGRESS_BAR, _URI_VARIABLE)}
    os.environ[_PROGRESS_BAR] = "false"
    try:
        with _use_tracking_uri(uri):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _tag_run(client, run_id: str, model_uri: str, step: int) -> None:
    """Name the model on the run, unless the run already names one of a later step (a model logged on request for
    an older checkpoint does not displace the final one)."""
    recorded = client.get_run(run_id).data.tags.get(keys.MODEL_STEP)
    if recorded is not None and recorded.lstrip("-").isdigit() and int(recorded) > step:
        return
    client.set_tag(run_id, keys.MODEL_URI, model_uri)
    client.set_tag(run_id, keys.MODEL_STEP, str(step))


def eval_means(client, run_id: str, step: int) -> dict[str, float]:
    """The run's eval means at ``step`` (every ``<family>/.../mean...`` eval metric, the value logged last)."""
    means = {}
    for key in client.get_run(run_id).data.metrics:
        if not key.startswith(keys.EVAL_PREFIXES) or "/mean" not in key:
            continue
        at_step = [m for m in client.get_metric_history(run_id, key) if m.step == step and math.isfinite(m.value)]
        if at_step:
            means[key] = max(at_step, key=lambda m: m.timestamp).value
    return dict(sorted(means.items()))


def _hf_shape(hf_dir: Path) -> tuple[int, int, int]:
    """(channels, side, outputs) of an HF ViT folder's config.json."""
    path = hf_dir / "config.json"
    try:
        config = json.loads(path.read_text())
        headless = "ViTModel" in (config.get("architectures") or [])
        outputs = config["hidden_size"] if headless else len(config["id2label"])
        return int(config.get("num_channels", 3)), int(config["image_size"]), int(outputs)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is not the config.json of an HF ViT export ({error}); write the folder with "
            "`python -m pretrain.weights export SOURCE OUT --format hf`"
        ) from None


def signature(hf_dir: Path):
    """Pixels (-1, C, S, S) float32 → logits (or features) (-1, K) float32."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    channels, side, outputs = _hf_shape(hf_dir)
    pixels = Schema([TensorSpec(np.dtype(np.float32), (-1, channels, side, side))])
    return ModelSignature(inputs=pixels, outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, outputs))]))


def input_example(hf_dir: Path):
    """One mid-grey image (zeros in [-1, 1]): small in JSON, and any image is a valid example."""
    import numpy as np

    channels, side, _ = _hf_shape(hf_dir)
    return np.zeros((1, channels, side, side), np.float32)


def requirements() -> list[str]:
    """Pinned to what wrote the model, without local labels (``2.13.0+cpu`` → ``2.13.0``, installable from PyPI)."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in _REQUIREMENTS]
