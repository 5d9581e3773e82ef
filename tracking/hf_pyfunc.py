"""The model code MLflow stores with every vitscale model (`tracking.models`); imports no vitscale. ``predict``:
pixels (B, C, H, W) float32 in [-1, 1] → logits (B, K), or a headless model's class-token features (B, D)."""

import mlflow
import numpy as np
import torch
from mlflow.pyfunc import PythonModel
from transformers import ViTConfig, ViTForImageClassification, ViTModel


class ViTLogits(PythonModel):
    def load_context(self, context):
        folder = context.artifacts["hf"]
        architectures = ViTConfig.from_pretrained(folder).architectures or []
        if "ViTModel" in architectures:  # a headless export: no pooler (vitscale's features are the class token's)
            self.model = ViTModel.from_pretrained(folder, add_pooling_layer=False)
        else:
            self.model = ViTForImageClassification.from_pretrained(folder)
        self.model.eval()

    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> np.ndarray:
        pixels = torch.from_numpy(np.ascontiguousarray(model_input, dtype=np.float32))
        with torch.no_grad():
            out = self.model(pixel_values=pixels)
        values = out.logits if hasattr(out, "logits") else out.last_hidden_state[:, 0]
        return values.numpy()


mlflow.models.set_model(ViTLogits())
