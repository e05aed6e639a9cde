"""RT-DETR's hybrid encoder (Zhao et al. 2024): input projections, AIFI, then CCFF.

    [C3, C4, C5] backbone maps (strides 8, 16, 32), NHWC, any channel counts
      -> encoder_input_proj.i: 1x1 conv (no bias) + batch norm to `hidden_dim`, per level
      -> AIFI (intra-scale interaction): transformer encoder layers on the levels in
         `encode_levels` (the stride-32 map), positions from `sincos_2d` added to q and k
      -> CCFF (cross-scale fusion): an FPN top-down (lateral 1x1 conv-norm-act, nearest 2x
         upsample, concat [upsampled, finer], CSPRep layer), then a PAN bottom-up (3x3
         stride-2 conv-norm-act, concat [downsampled, FPN map], CSPRep layer)
      -> [P3, P4, P5] NHWC, `hidden_dim` channels each, the input maps' sizes

D-FINE's encoder is this one with other CCFF parts injected (dfine_encoder.py: RepNCSPELAN4
blocks, SCDown downsampling, lateral convs without activation).

Layer names are the transformers 5.x module paths of RTDetrModel (`encoder_input_proj.0`,
`encoder.aifi.0`, `encoder.fpn_blocks.1`, ...); detr_tf.weights.rtdetr.encoder maps every
tensor of theirs to a variable here. RT-DETR has no pixel mask: the convolutions and AIFI's
attention see the whole canvas, padding included.

The fusion concatenates a map upsampled 2x with the next finer one, so every level must be
exactly twice the next coarser one in height and width: canvases that are multiples of 32.

Batch norm is trainable, with the global batch's statistics across Mirrored replicas as the
reference's SyncBatchNorm; csp_rep.py's docstring says more.
"""
from typing import Callable, Optional, Sequence

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling import activations
from detr_tf.modeling.activations import Activation
from detr_tf.modeling.csp_rep import ConvNorm, CSPRepLayer
from detr_tf.modeling.dropout import Dropout
from detr_tf.modeling.layers import FeedForward, layer_norm
from detr_tf.modeling.position_encoding import sincos_2d
from detr_tf.modeling.transformer import MultiHeadAttention


class AIFILayer(tf_keras.layers.Layer):
    """One post-norm transformer encoder layer, transformers' RTDetrEncoderLayer:

        x = self_attn_layer_norm(x + dropout(SA(q = k = x + pos, v = x)))
        x = final_layer_norm(x + dropout(fc2(dropout_act(act(fc1(x))))))

    The attention weights are dropped at `dropout` too (transformers uses config.dropout there,
    not attention_dropout). Sequences are [B, S, d].
    """

    def __init__(self, d_model: int, num_heads: int, dim_feedforward: int, dropout: float,
                 activation_dropout: float, activation: Activation, **kwargs):
        super().__init__(**kwargs)
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout, name="self_attn")
        self.self_attn_layer_norm = layer_norm("self_attn_layer_norm")
        self.mlp = FeedForward(d_model, dim_feedforward, activation_dropout,
                               activations.get(activation), name="mlp")
        self.final_layer_norm = layer_norm("final_layer_norm")
        self.attn_dropout = Dropout(dropout)
        self.mlp_dropout = Dropout(dropout)

    def call(self, x: tf.Tensor, pos: tf.Tensor, training: Optional[bool] = None) -> tf.Tensor:
        """x: [B, S, d]; pos: [1 or B, S, d] -> [B, S, d]."""
        qk = x + pos
        y = self.self_attn(qk, qk, x, training=training)
        x = self.self_attn_layer_norm(x + self.attn_dropout(y, training=training))
        y = self.mlp(x, training=training)
        return self.final_layer_norm(x + self.mlp_dropout(y, training=training))


class AIFI(tf_keras.layers.Layer):
    """`num_layers` AIFILayers over a flattened map with RT-DETR's 2-D sin-cos positions."""

    def __init__(self, d_model: int, num_layers: int, temperature: float, num_heads: int,
                 dim_feedforward: int, dropout: float, activation_dropout: float,
                 activation: Activation, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.temperature = temperature
        self.layers = [AIFILayer(d_model, num_heads, dim_feedforward, dropout, activation_dropout,
                                 activation, name=f"layers.{j}") for j in range(num_layers)]

    def call(self, x: tf.Tensor, training: Optional[bool] = None) -> tf.Tensor:
        """[B, h, w, d] -> [B, h, w, d]."""
        b, h, w = tf.shape(x)[0], tf.shape(x)[1], tf.shape(x)[2]
        pos = tf.cast(sincos_2d(h, w, self.d_model, self.temperature), x.dtype)[None]
        seq = tf.reshape(x, [b, h * w, self.d_model])  # [B, S, d], row-major like pos
        for layer in self.layers:
            seq = layer(seq, pos, training=training)
        # Keeps x's static sizes (a dynamic batch would otherwise erase them all).
        return tf.ensure_shape(tf.reshape(seq, tf.shape(x)), x.shape)


def _upsample2x(x: tf.Tensor) -> tf.Tensor:
    """Nearest-neighbour 2x: each pixel becomes a 2x2 block (torch's nearest, scale 2)."""
    return tf.repeat(tf.repeat(x, 2, axis=1), 2, axis=2)


def _check_sizes(coarse: tf.Tensor, fine: tf.Tensor, where: str) -> None:
    """A static size mismatch named, instead of concat's shape error deep in the graph."""
    for axis in (1, 2):
        c, f = coarse.shape[axis], fine.shape[axis]
        if c is not None and f is not None and 2 * c != f:
            raise ValueError(f"HybridEncoder {where}: a level of size {tuple(fine.shape[1:3])} "
                             f"is not twice the next coarser {tuple(coarse.shape[1:3])}; the "
                             f"canvas must be a multiple of 32")


@gin.configurable
class HybridEncoder(tf_keras.layers.Layer):
    """RT-DETR's encoder_input_proj + hybrid encoder (module docstring). Defaults are R50vd's.

    Arguments and their transformers RTDetrConfig names: hidden_dim (encoder_hidden_dim),
    num_levels (len(encoder_in_channels)), encode_levels (encode_proj_layers), num_layers
    (encoder_layers), num_heads (encoder_attention_heads), dim_feedforward (encoder_ffn_dim),
    dropout, activation_dropout, encoder_activation (encoder_activation_function), activation
    (activation_function, of every conv block), hidden_expansion, num_blocks (RepVGG blocks per
    CSPRep layer; transformers fixes 3), temperature (positional_encoding_temperature).
    Activations are names (activations.get: 'gelu' is the exact, erf-based GELU, as torch's)
    or callables.

    The CCFF's parts are injected, so D-FINE's variant (dfine_encoder.py) is this class with
    other parts: `fusion_block` builds the FPN and PAN blocks as
    `fusion_block(hidden_dim, hidden_expansion=, num_blocks=, activation=, name=)` (RT-DETR's
    CSPRepLayer; D-FINE's RepNCSPELAN4); `downsample`, if given, builds the PAN's stride-2
    downsamplings as `downsample(hidden_dim, name=)` (None: RT-DETR's 3x3 stride-2
    conv-norm-act; D-FINE's SCDown); `lateral_activation` False drops the activation of the
    FPN's lateral 1x1 conv-norms (D-FINE's have none).
    """

    def __init__(self, hidden_dim: int = 256, num_levels: int = 3,
                 encode_levels: Sequence[int] = (2,), num_layers: int = 1, num_heads: int = 8,
                 dim_feedforward: int = 1024, dropout: float = 0.0,
                 activation_dropout: float = 0.0, encoder_activation: Activation = "gelu",
                 activation: Activation = "silu", hidden_expansion: float = 1.0,
                 num_blocks: int = 3, temperature: float = 10000.0,
                 fusion_block: Callable[..., tf_keras.layers.Layer] = CSPRepLayer,
                 downsample: Optional[Callable[..., tf_keras.layers.Layer]] = None,
                 lateral_activation: bool = True, **kwargs):
        kwargs.setdefault("name", "hybrid_encoder")
        super().__init__(**kwargs)
        bad = [i for i in encode_levels if not 0 <= i < num_levels]
        if bad:
            raise ValueError(f"HybridEncoder.encode_levels={tuple(encode_levels)}: levels {bad} "
                             f"are not in [0, num_levels={num_levels})")
        self.hidden_dim = hidden_dim
        self.num_levels = num_levels
        self.out_channels = (hidden_dim,) * num_levels  # as the backbone's, for the decoder
        self.encode_levels = tuple(encode_levels)
        self.input_proj = [ConvNorm(hidden_dim, 1, conv_name="0", norm_name="1",
                                    name=f"encoder_input_proj.{i}") for i in range(num_levels)]
        self.aifi = [AIFI(hidden_dim, num_layers, temperature, num_heads=num_heads,
                          dim_feedforward=dim_feedforward, dropout=dropout,
                          activation_dropout=activation_dropout, activation=encoder_activation,
                          name=f"encoder.aifi.{i}") for i in range(len(self.encode_levels))]
        block = dict(hidden_expansion=hidden_expansion, num_blocks=num_blocks,
                     activation=activation)
        stages = range(num_levels - 1)
        self.lateral_convs = [
            ConvNorm(hidden_dim, 1, activation=activation if lateral_activation else None,
                     name=f"encoder.lateral_convs.{i}") for i in stages]
        self.fpn_blocks = [fusion_block(hidden_dim, name=f"encoder.fpn_blocks.{i}", **block)
                           for i in stages]
        if downsample is None:
            self.downsample_convs = [
                ConvNorm(hidden_dim, 3, strides=2, activation=activation,
                         name=f"encoder.downsample_convs.{i}") for i in stages]
        else:
            self.downsample_convs = [downsample(hidden_dim, name=f"encoder.downsample_convs.{i}")
                                     for i in stages]
        self.pan_blocks = [fusion_block(hidden_dim, name=f"encoder.pan_blocks.{i}", **block)
                           for i in stages]

    def call(self, features: Sequence[tf.Tensor], training: Optional[bool] = None):
        """Encodes the backbone's maps.

        Args:
          features: [C3, C4, C5] (num_levels maps, finest first), each [B, H_l, W_l, C_l];
            every level twice the next coarser one in H and W.
          training: batch statistics and dropout on (True) or moving statistics (False/None).

        Returns:
          [P3, P4, P5]: [B, H_l, W_l, hidden_dim] each, finest first.
        """
        if len(features) != self.num_levels:
            raise ValueError(f"HybridEncoder got {len(features)} feature maps; expected "
                             f"num_levels={self.num_levels}")
        maps = [proj(f, training=training) for proj, f in zip(self.input_proj, features)]
        for aifi, level in zip(self.aifi, self.encode_levels):
            maps[level] = aifi(maps[level], training=training)
        return self._pan(self._fpn(maps, training), training)

    def _fpn(self, maps, training):
        """Top-down; returns the FPN maps finest first. The coarsest is the lateral conv's
        output (the PAN's last concat reads it), the others the FPN blocks'."""
        out = [maps[-1]]
        for i, (lateral, block) in enumerate(zip(self.lateral_convs, self.fpn_blocks)):
            out[-1] = lateral(out[-1], training=training)
            finer = maps[self.num_levels - 2 - i]
            _check_sizes(out[-1], finer, f"FPN stage {i}")
            out.append(block(tf.concat([_upsample2x(out[-1]), finer], -1), training=training))
        return out[::-1]

    def _pan(self, fpn, training):
        """Bottom-up over the FPN maps (finest first); returns [P3, P4, P5]."""
        out = [fpn[0]]
        for i, (down, block) in enumerate(zip(self.downsample_convs, self.pan_blocks)):
            x = down(out[-1], training=training)
            out.append(block(tf.concat([x, fpn[i + 1]], -1), training=training))
        return out

    def fuse(self) -> None:
        """Every RepVGG block to its inference form (csp_rep.RepVggBlock.fuse): one 3x3 conv
        with bias in place of two conv-BN branches. Call after the weights are final. Each
        fusion block fuses its own (CSPRepLayer.fuse, RepNCSPELAN4.fuse)."""
        for block in self.fpn_blocks + self.pan_blocks:
            block.fuse()
