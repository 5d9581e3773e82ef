"""A run's model in MLflow: an HF ViT folder logged as a model of the run (docs/contracts.md, "The run's model in
MLflow"). ``mlflow`` is imported inside functions: the weights CLI imports this module."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
from pathlib import Path
from typing import Any

from tracking import keys
from tracking.store import default_tracking_uri, unanswered

MODEL_NAME = "model"
HF_ARTIFACT = "hf"  # the folder's name among the model's artifacts
CODE_FILE = Path(__file__).with_name("hf_pyfunc.py")
_REQUIREMENTS = ("torch", "transformers", "numpy", "safetensors")
_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
_URI_VARIABLE = "MLFLOW_TRACKING_URI"


def log_hf_model(
    hf_dir: str | Path, run_id: str, tracking_uri: str | None = None, *, step: int | None, source: Any = None
) -> str:
    """Log ``hf_dir`` as a model of ``run_id`` at checkpoint ``step``; returns its URI (``models:/m-…``). ValueError
    naming the fix: those of `loggable_run`, no HF ViT folder."""
    import mlflow  # heavy

    hf_dir = Path(hf_dir)
    uri = tracking_uri or default_tracking_uri()
    run = loggable_run(run_id, uri, step=step, source=source or hf_dir)
    assert step is not None  # refused by loggable_run
    client = mlflow.MlflowClient(tracking_uri=uri)
    spec, example = signature(hf_dir), input_example(hf_dir)  # refuses a folder that is no HF ViT export
    means = eval_means(client, run_id, step)
    tags = {keys.MODEL_TAG_STEP: str(step), keys.MODEL_TAG_SOURCE: str(source or hf_dir)}
    tags |= {keys.MODEL_TAG_EVAL_PREFIX + key: repr(value) for key, value in means.items()}
    # In the run's experiment (log_model would use the process's active one).
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


def loggable_run(run_id: str, tracking_uri: str | None = None, *, step: int | None, source: Any):
    """The MLflow run a model of checkpoint ``source`` (at ``step``) is logged into, checked before anything is
    written; ValueError naming the fix: ``step`` None (no training checkpoint), transformers missing, no such run."""
    import mlflow  # heavy
    from mlflow.exceptions import MlflowException

    if step is None:
        raise ValueError(
            f"{source} is no training checkpoint: only a checkpoint (or a run folder: its newest one) is logged into "
            "a run, at its step"
        )
    _require_transformers()
    uri = tracking_uri or default_tracking_uri()
    if down := unanswered(uri):  # in seconds: MLflow's own retries last minutes
        raise ValueError(f"no MLflow server answers at {uri} ({down}); start it or fix --tracking-uri")
    try:
        return mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            reason = (str(error).strip() or "no details").splitlines()[0][:200]
            raise ValueError(f"cannot read MLflow run {run_id!r} in {uri} ({reason}); check --tracking-uri") from None
        raise ValueError(
            f"MLflow run {run_id!r} is not in {uri}; pass a run id `make ui` lists, and --tracking-uri "
            "for a store other than the project's"
        ) from None


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
    """MLflow's process-wide tracking URI (and no progress bars) for the call; all restored after."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

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
    """Name the model on the run unless it already names one of a later step."""
    recorded = client.get_run(run_id).data.tags.get(keys.MODEL_STEP)
    if recorded is not None and recorded.lstrip("-").isdigit() and int(recorded) > step:
        return
    client.set_tag(run_id, keys.MODEL_URI, model_uri)
    client.set_tag(run_id, keys.MODEL_STEP, str(step))


def eval_means(client, run_id: str, step: int) -> dict[str, float]:
    """The run's eval means (`keys.is_eval_mean`) at ``step``, each logged last."""
    means = {}
    for key in client.get_run(run_id).data.metrics:
        if not keys.is_eval_mean(key):
            continue
        at_step = [m for m in client.get_metric_history(run_id, key) if m.step == step and math.isfinite(m.value)]
        if at_step:
            means[key] = max(at_step, key=lambda m: m.timestamp).value
    return dict(sorted(means.items()))


def _hf_shape(hf_dir: Path) -> tuple[int, int, int]:
    """(channels, side, outputs) from config.json."""
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
    """One mid-grey image (zeros): small in JSON."""
    import numpy as np

    channels, side, _ = _hf_shape(hf_dir)
    return np.zeros((1, channels, side, side), np.float32)


def requirements() -> list[str]:
    """Pinned to what wrote the model, local labels dropped (``2.13.0+cpu`` → ``2.13.0``)."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in _REQUIREMENTS]
