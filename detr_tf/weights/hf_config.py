"""The config.json that transformers' save_pretrained writes beside a model's weights.

A setting that changes the outputs without changing any tensor's shape cannot be told from the
weights: a DETR-DC5 file (`"dilation": true`, the last stage dilated instead of strided) fits a
plain DETR-R50 exactly and gives other outputs. Where the file has a config.json beside it, such
settings are checked against the configured model.
"""
import json
import os
from typing import Optional

import tf_keras

from detr_tf.modeling.backbone import ResNet
from detr_tf.weights.files import WeightImportError

CONFIG_FILE = "config.json"


def _config_beside(path: str) -> Optional[str]:
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    found = os.path.join(folder, CONFIG_FILE)
    return found if os.path.isfile(found) else None


def check_beside(model: tf_keras.Model, path: str, fmt: str) -> None:
    """Refuses a Hugging Face DETR file whose config.json sets a dilation (DC5) other than the
    configured model's backbone; nothing to check without a config.json or a ResNet.

    Raises:
      WeightImportError: naming the config.json, its setting and the model's.
    """
    config_path = _config_beside(path)
    if config_path is None or not fmt.startswith("Hugging Face DetrForObjectDetection"):
        return
    try:
        with open(config_path) as f:
            dilation = json.load(f).get("dilation")
    except (OSError, ValueError, AttributeError):
        return  # not transformers' config: the weights alone decide, as without one
    resnets = [m for m in model.submodules if isinstance(m, ResNet)]
    if not isinstance(dilation, bool) or not resnets or resnets[0].dilation == dilation:
        return
    ours = "dilated (DC5)" if resnets[0].dilation else "strided, not dilated"
    raise WeightImportError(
        f"{path!r}: {config_path} sets \"dilation\": {str(dilation).lower()}, but the configured "
        f"model's last backbone stage is {ours} (ResNet.dilation = {resnets[0].dilation}): the "
        "weights fit both, the outputs differ; give the matching model file "
        f"({'models/detr_r50_dc5.gin' if dilation else 'models/detr_r50.gin'} or its R101 "
        "twin); nothing was imported")
