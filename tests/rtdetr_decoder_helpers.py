"""RT-DETR decoders built in detr_tf from a transformers config, weights loaded through the
table, and simple stand-ins for the backbone and the encoder."""
from typing import Dict, Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.modeling.rtdetr import RTDETR
from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder
from detr_tf.weights.rtdetr.decoder import PREFIX, decoder_targets


def decoder_from_config(config: dict, version: int = 1, decoder_offset_scale: float = 0.5,
                        decoder_method: str = "default", **kwargs) -> RTDetrDecoder:
    """The RTDetrDecoder of a transformers config dict (tools/make_rtdetr_decoder_fixtures.py's
    CONFIG plus a variant's options), unbuilt."""
    del version  # v1 is v2 with offset scale 0.5 and bilinear sampling
    return RTDetrDecoder(
        num_classes=config["num_labels"], d_model=config["d_model"],
        num_queries=config["num_queries"], num_layers=config["decoder_layers"],
        num_heads=config["decoder_attention_heads"], dim_feedforward=config["decoder_ffn_dim"],
        num_levels=config["num_feature_levels"], encoder_levels=3,
        num_points=config["decoder_n_points"], offset_scale=decoder_offset_scale,
        method="bilinear" if decoder_method == "default" else decoder_method,
        learn_initial_query=config.get("learn_initial_query", False), **kwargs)


def load(decoder: RTDetrDecoder, features: Sequence[np.ndarray],
         params: Dict[str, np.ndarray]) -> None:
    """Builds the decoder on `features` and assigns the transformers weights `params` (the
    decoder's keys; others are ignored) through decoder_targets, checking the coverage."""
    decoder([tf.constant(f) for f in features], training=False)
    table = decoder_targets(PREFIX, decoder)
    wanted = {k for k in params if not k.startswith(f"{PREFIX}.denoising_class_embed")}
    assert set(table) == wanted, (sorted(set(table) ^ wanted))[:6]
    for key, target in table.items():
        value = params[key]
        assert tuple(value.shape) == target.torch_shape, (key, value.shape, target.torch_shape)
        target.variable.assign(target.from_torch(value))


def run(decoder: RTDetrDecoder, features: Sequence[np.ndarray]) -> Dict[str, np.ndarray]:
    """Inference outputs as numpy: logits [L, B, Q, C], boxes, enc_logits, enc_boxes."""
    out = decoder([tf.constant(f) for f in features], training=False)
    return {"logits": out["pred_logits"].numpy(), "boxes": out["pred_boxes"].numpy(),
            "enc_logits": out["enc_outputs"]["pred_logits"].numpy(),
            "enc_boxes": out["enc_outputs"]["pred_boxes"].numpy()}


def compare(ours: Dict[str, np.ndarray], ref: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Max |diff| per output, asserting logits within 1e-3 and boxes within 1e-4."""
    diffs = {}
    for key in ("logits", "boxes", "enc_logits", "enc_boxes"):
        assert ours[key].shape == ref[key].shape, (key, ours[key].shape, ref[key].shape)
        diffs[key] = float(np.max(np.abs(ours[key] - ref[key])))
        assert diffs[key] < (1e-3 if "logits" in key else 1e-4), (key, diffs[key])
    return diffs


class StandInBackbone(tf_keras.layers.Layer):
    """[C3, C4, C5] at strides 8, 16, 32: average pools of the image and a 1x1 conv each."""

    def __init__(self, out_channels=(8, 12, 16), **kwargs):
        super().__init__(**kwargs)
        self.out_channels = tuple(out_channels)
        self.convs = [tf_keras.layers.Conv2D(c, 1, name=f"conv{i}")
                      for i, c in enumerate(out_channels)]

    def call(self, images, training=None):
        return [conv(tf.nn.avg_pool2d(images, 8 * 2 ** i, 8 * 2 ** i, "SAME"))
                for i, conv in enumerate(self.convs)]


class StandInEncoder(tf_keras.layers.Layer):
    """[C3, C4, C5] -> [P3, P4, P5]: a 1x1 conv to `channels` each, a tanh."""

    def __init__(self, channels: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.out_channels = (channels,) * 3
        self.convs = [tf_keras.layers.Conv2D(channels, 1, name=f"proj{i}") for i in range(3)]

    def call(self, features, training=None):
        return [tf.tanh(conv(x)) for conv, x in zip(self.convs, features)]


def tiny_model(num_classes: int = 5, num_queries: int = 10, denoising: bool = True,
               **decoder_args) -> RTDETR:
    """RT-DETR with the stand-ins, d_model 16, 2 heads, 2 layers, 3 levels."""
    from detr_tf.modeling.rtdetr import build_rtdetr

    return build_rtdetr(num_classes=num_classes, num_queries=num_queries, hidden_dim=16,
                        backbone=StandInBackbone(), encoder=StandInEncoder(),
                        num_decoder_layers=2, num_heads=2, dim_feedforward=32,
                        denoising=denoising, **decoder_args)
