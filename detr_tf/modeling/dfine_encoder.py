"""D-FINE's hybrid encoder (Peng et al. 2024): RT-DETR's, with other CCFF blocks.

The input projections and AIFI are RT-DETR's (hybrid_encoder.py). The cross-scale fusion keeps
its FPN / PAN wiring with three differences:

    - the FPN's lateral 1x1 conv-norms have no activation;
    - each FPN and PAN block is a RepNCSPELAN4 (GELAN-style: a 1x1 conv split in two halves,
      two CSPRep + 3x3 conv stages chained on the second half, every stage's output
      concatenated and fused by a 1x1 conv) in place of one CSPRep layer;
    - the PAN downsamples with SCDown: a 1x1 conv-norm, then a depthwise 3x3 stride-2 conv-norm,
      in place of a full 3x3 stride-2 conv-norm-act.

`dfine_hybrid_encoder` builds the HybridEncoder with these parts from transformers'
DFineConfig options. Layer names are transformers 5.x's DFineModel module paths
(`encoder.fpn_blocks.0.csp_rep1.bottlenecks.0.conv1`, `encoder.downsample_convs.1.conv2`, ...);
detr_tf.weights.dfine.encoder maps every tensor of theirs to a variable here. The RepVGG blocks
inside fuse for inference as RT-DETR's (`HybridEncoder.fuse`).
"""
from typing import Optional

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling.activations import Activation
from detr_tf.modeling.backbone import TorchDepthwiseConv2D, batch_norm
from detr_tf.modeling.csp_rep import ConvNorm, CSPRepLayer
from detr_tf.modeling.hybrid_encoder import HybridEncoder


class DepthwiseConvNorm(tf_keras.layers.Layer):
    """A depthwise conv (`conv`) then batch norm (`norm`), no activation."""

    def __init__(self, channels: int, kernel_size: int, strides: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.conv = TorchDepthwiseConv2D(channels, kernel_size, strides, name="conv")
        self.norm = batch_norm("norm")

    def call(self, x: tf.Tensor, training: Optional[bool] = None) -> tf.Tensor:
        return self.norm(self.conv(x), training=training)


@gin.configurable
class SCDown(tf_keras.layers.Layer):
    """transformers' DFineSCDown: conv1 (1x1 conv-norm, mixes channels) then conv2 (depthwise
    kxk stride-s conv-norm, downsamples each channel), no activation. A cheap stand-in for a
    full kxk stride-s conv: C^2 + k^2 C weights instead of k^2 C^2."""

    def __init__(self, channels: int, kernel_size: int = 3, strides: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = ConvNorm(channels, 1, name="conv1")
        self.conv2 = DepthwiseConvNorm(channels, kernel_size, strides, name="conv2")

    def call(self, x: tf.Tensor, training: Optional[bool] = None) -> tf.Tensor:
        """[B, H, W, channels] -> [B, ceil(H / strides), ceil(W / strides), channels]."""
        return self.conv2(self.conv1(x, training=training), training=training)


def elan_width(out_channels: int, hidden_expansion: float) -> int:
    """The width of RepNCSPELAN4's CSPRep stages, as transformers computes it:
    round(hidden_expansion * out_channels // 2) (D-FINE-S: 0.5 * 256 // 2 = 64)."""
    return round(hidden_expansion * out_channels // 2)


@gin.configurable
class RepNCSPELAN4(tf_keras.layers.Layer):
    """transformers' DFineRepNCSPELAN4, D-FINE's fusion block:

        a, b = split(conv1(x), 2)                 # 1x1 to 2 * out_channels, two halves
        c = conv2(csp_rep1(b))                    # CSPRep to `width`, 3x3 conv-norm-act
        d = conv3(csp_rep2(c))                    # the same again on c
        out = conv4(concat([a, b, c, d]))         # 1x1 back to out_channels

    width = elan_width(out_channels, hidden_expansion). The CSPRep layers (expansion 1, so no
    conv3 of their own) have `num_blocks` RepVGG blocks and use `activation`; the four convs
    use `conv_activation` (transformers fixes SiLU there whatever activation_function says).
    The signature is HybridEncoder's `fusion_block`'s.
    """

    def __init__(self, out_channels: int, hidden_expansion: float = 1.0, num_blocks: int = 3,
                 activation: Activation = "silu", conv_activation: Activation = "silu",
                 **kwargs):
        super().__init__(**kwargs)
        width = elan_width(out_channels, hidden_expansion)
        self.conv1 = ConvNorm(2 * out_channels, 1, activation=conv_activation, name="conv1")
        self.csp_rep1 = CSPRepLayer(width, 1.0, num_blocks, activation, name="csp_rep1")
        self.conv2 = ConvNorm(width, 3, activation=conv_activation, name="conv2")
        self.csp_rep2 = CSPRepLayer(width, 1.0, num_blocks, activation, name="csp_rep2")
        self.conv3 = ConvNorm(width, 3, activation=conv_activation, name="conv3")
        self.conv4 = ConvNorm(out_channels, 1, activation=conv_activation, name="conv4")

    def call(self, x: tf.Tensor, training: Optional[bool] = None) -> tf.Tensor:
        """[B, H, W, C_in] -> [B, H, W, out_channels]."""
        a, b = tf.split(self.conv1(x, training=training), 2, axis=-1)  # [B, H, W, out] each
        c = self.conv2(self.csp_rep1(b, training=training), training=training)  # [.., width]
        d = self.conv3(self.csp_rep2(c, training=training), training=training)
        return self.conv4(tf.concat([a, b, c, d], -1), training=training)

    def fuse(self) -> None:
        """Both CSPRep layers' RepVGG blocks to their inference form."""
        self.csp_rep1.fuse()
        self.csp_rep2.fuse()


@gin.configurable
def dfine_hybrid_encoder(hidden_expansion: float = 1.0, depth_mult: float = 1.0,
                         **kwargs) -> HybridEncoder:
    """D-FINE's encoder_input_proj + hybrid encoder: a HybridEncoder with RepNCSPELAN4 fusion
    blocks, SCDown downsampling and lateral convs without activation.

    Args:
      hidden_expansion: DFineConfig's; sets the RepNCSPELAN4 stages' width (elan_width).
      depth_mult: DFineConfig's; round(3 * depth_mult) RepVGG blocks per CSPRep layer
        (D-FINE-S's 0.34 gives 1).
      **kwargs: HybridEncoder's other arguments (hidden_dim, num_levels, encode_levels,
        num_heads, dim_feedforward, ...), under HybridEncoder's names.
    """
    return HybridEncoder(hidden_expansion=hidden_expansion, num_blocks=round(3 * depth_mult),
                         fusion_block=RepNCSPELAN4, downsample=SCDown, lateral_activation=False,
                         **kwargs)
