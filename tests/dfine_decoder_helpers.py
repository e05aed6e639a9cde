"""D-FINE decoders built in detr_tf from a transformers config dict, weights loaded through the
table, run and compared (tests/test_dfine_decoder.py and its torch twin)."""
from typing import Dict, Sequence

import numpy as np
import tensorflow as tf

from detr_tf.modeling.dfine_decoder import DFineDecoder
from detr_tf.weights.dfine.decoder import PREFIX, decoder_targets

TOLERANCES = {"logits": 1e-3, "boxes": 1e-4, "corners": 1e-3, "ref_points": 1e-4,
              "pre_logits": 1e-3, "pre_boxes": 1e-4, "enc_logits": 1e-3, "enc_boxes": 1e-4}


def decoder_from_config(config: dict, **kwargs) -> DFineDecoder:
    """The DFineDecoder of a transformers DFineConfig dict (tools/make_dfine_decoder_fixtures
    .py's CONFIG with a variant's options), unbuilt."""
    method = config.get("decoder_method", "default")
    return DFineDecoder(
        num_classes=config["num_labels"], d_model=config["d_model"],
        num_queries=config["num_queries"], num_layers=config["decoder_layers"],
        num_heads=config["decoder_attention_heads"], dim_feedforward=config["decoder_ffn_dim"],
        num_levels=config["num_feature_levels"], encoder_levels=3,
        num_points=config["decoder_n_points"],
        offset_scale=config.get("decoder_offset_scale", 0.5),
        method="bilinear" if method == "default" else method,
        identity_input_proj=config.get("encoder_hidden_dim", 256) == config["d_model"],
        reg_max=config.get("max_num_bins", 32), up=config.get("up", 0.5),
        reg_scale=config.get("reg_scale", 4.0), top_prob_values=config.get("top_prob_values", 4),
        lqe_hidden_dim=config.get("lqe_hidden_dim", 64), lqe_layers=config.get("lqe_layers", 2),
        **kwargs)


def load(decoder: DFineDecoder, features: Sequence[np.ndarray],
         params: Dict[str, np.ndarray]) -> None:
    """Builds the decoder on `features` (eval mode) and assigns the transformers weights
    `params` through decoder_targets, checking that every key is used and every variable
    targeted, once."""
    decoder([tf.constant(f) for f in features], training=False)
    table = decoder_targets(PREFIX, decoder)
    wanted = {k for k in params if not k.startswith(f"{PREFIX}.denoising_class_embed")}
    assert set(table) == wanted, sorted(set(table) ^ wanted)[:6]
    variables = [t.variable.ref() for t in table.values()]
    assert len(set(variables)) == len(variables) == len(decoder.variables)
    for key, target in table.items():
        value = params[key]
        assert tuple(value.shape) == target.torch_shape, (key, value.shape, target.torch_shape)
        target.variable.assign(target.from_torch(value))


def run(decoder: DFineDecoder, features: Sequence[np.ndarray], training: bool,
        **kwargs) -> Dict[str, np.ndarray]:
    """The decoder's outputs as numpy under the oracle's names (training: every layer and the
    pre outputs; eval: the last layer run)."""
    out = decoder([tf.constant(f) for f in features], training=training, **kwargs)
    got = {"logits": out["pred_logits"], "boxes": out["pred_boxes"],
           "corners": out["pred_corners"], "ref_points": out["ref_points"],
           "enc_logits": out["enc_outputs"]["pred_logits"],
           "enc_boxes": out["enc_outputs"]["pred_boxes"]}
    if training:
        got.update(pre_logits=out["pre_logits"], pre_boxes=out["pre_boxes"])
    else:
        got.update({k: got[k][-1:] for k in ("logits", "boxes", "corners")})
    return {k: v.numpy() for k, v in got.items()}


def compare(ours: Dict[str, np.ndarray], ref: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Max |diff| of every output both have, asserting TOLERANCES (logits 1e-3, boxes 1e-4;
    the corners are logits)."""
    diffs = {}
    for key, tol in TOLERANCES.items():
        if key not in ours or key not in ref:
            continue
        assert ours[key].shape == ref[key].shape, (key, ours[key].shape, ref[key].shape)
        diffs[key] = float(np.max(np.abs(ours[key] - ref[key])))
        assert diffs[key] < tol, (key, diffs[key])
    return diffs
