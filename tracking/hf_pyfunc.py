"""The model code MLflow stores with every vitscale model (`tracking.models.log_hf_model`, MLflow "models from code").

MLflow copies this file into the logged model and runs it when the model is loaded: it imports only torch, numpy,
transformers and mlflow, never vitscale, so `mlflow.pyfunc.load_model(uri)` works wherever those are installed,
offline (the weights are the model's own artifact ``hf``, an HF ViT folder written by
`pretrain.weights.export.save_hf`).

``predict`` takes pixel values (B, C, H, W) float32 in [-1, 1] (what `preprocessor_config.json` in the folder makes
of an image) and returns the logits (B, num_classes) of ViTForImageClassification, or for a model without a head the
class token's final features (B, D) of ViTModel: the numbers vitscale's own forward gives. Nothing is pickled: the
logged model is this source file plus the folder.
"""

import mlflow
import numpy as np
import torch
from mlflow.pyfunc import PythonModel
from transformers import ViTConfig, ViTForImageClassification, ViTModel


class ViTLogits(PythonModel):
    """pyfunc over an HF ViT folder: pixels in, logits (or features) out, in eval mode."""

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
