"""RT-DETR's convolution blocks: conv-norm-act, the RepVGG block, and the CSP layer made of them.

Padding is torch's: k // 2 zeros on every side, then a 'valid' conv (backbone.TorchConv2D).
TF's 'same' pads a stride-2 conv with more zeros at the bottom/right, which would shift the
PAN's downsampled grid by one pixel against the reference.

Batch norm. Every norm here is a trainable batch norm with torch's epsilon 1e-5 and momentum 0.1
(`backbone.batch_norm`). In training mode it normalises with the mean and variance of the global
batch, over B * H * W positions: under Mirrored and MultiWorkerMirrored the replicas all-reduce
them, as the reference's SyncBatchNorm does over its GPUs (Horovod's processes each keep their
own). The moving variance moves by the unbiased batch variance, as torch's. In inference mode
the moving statistics are used, and the outputs match the reference.

The RepVGG block (Ding et al. 2021) trains as two branches, a 3x3 conv-BN and a 1x1 conv-BN,
summed before the activation. Both are linear in the input once the norms use their moving
statistics, so `RepVggBlock.fuse` folds them into one 3x3 conv with a bias for inference.
"""
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.modeling import activations
from detr_tf.modeling.activations import Activation
from detr_tf.modeling.backbone import TorchConv2D, batch_norm


class ConvNorm(tf_keras.layers.Layer):
    """A bias-free conv with torch's padding, batch norm, then the activation (None: none).

    `conv_name` / `norm_name` are the two layers' names: 'conv' / 'norm' as in transformers'
    RTDetrConvNormLayer, '0' / '1' for the encoder's input projections (an nn.Sequential).
    """

    def __init__(self, filters: int, kernel_size: int, strides: int = 1,
                 activation: Activation = None, conv_name: str = "conv",
                 norm_name: str = "norm", **kwargs):
        super().__init__(**kwargs)
        self.conv = TorchConv2D(filters, kernel_size, strides, name=conv_name)
        self.norm = batch_norm(norm_name)
        self.activation = activations.get(activation) if activation else None

    def call(self, x: tf.Tensor, training: Optional[bool] = None) -> tf.Tensor:
        """[B, H, W, C_in] -> [B, ceil(H / stride), ceil(W / stride), filters]."""
        x = self.norm(self.conv(x), training=training)
        return self.activation(x) if self.activation else x

    def folded(self) -> Tuple[np.ndarray, np.ndarray]:
        """The conv and its norm at the moving statistics as one float64 kernel and bias."""
        gamma, beta, mean, var = (np.asarray(v.numpy(), np.float64) for v in (
            self.norm.gamma, self.norm.beta, self.norm.moving_mean,
            self.norm.moving_variance))
        scale = gamma / np.sqrt(var + self.norm.epsilon)  # [out]
        kernel = np.asarray(self.conv.kernel.numpy(), np.float64) * scale  # [kh, kw, in, out]
        return kernel, beta - mean * scale


class RepVggBlock(tf_keras.layers.Layer):
    """act(conv1(x) + conv2(x)): a 3x3 and a 1x1 conv-BN branch, channels in = out.

    After `fuse()` it computes act(conv(x)) with one 3x3 conv with bias, equal to the two
    branches at the norms' moving statistics: an inference form. The branches' variables stay
    (a checkpoint still loads), unused; training a fused block would train `conv` alone.
    """

    def __init__(self, channels: int, activation: Activation = "silu", **kwargs):
        super().__init__(**kwargs)
        self.channels = channels
        self.conv1 = ConvNorm(channels, 3, name="conv1")
        self.conv2 = ConvNorm(channels, 1, name="conv2")
        self.activation = activations.get(activation) if activation else None
        # The fused form's conv, built by fuse(); 'same' pads a stride-1 3x3 conv by 1 on every
        # side, exactly as torch does.
        self.conv = tf_keras.layers.Conv2D(channels, 3, padding="same", name="conv")
        self.fused = False

    def call(self, x: tf.Tensor, training: Optional[bool] = None) -> tf.Tensor:
        """[B, H, W, channels] -> [B, H, W, channels]."""
        if self.fused:
            y = self.conv(x)
        else:
            y = self.conv1(x, training=training) + self.conv2(x, training=training)
        return self.activation(y) if self.activation else y

    def fused_weights(self) -> Tuple[np.ndarray, np.ndarray]:
        """Kernel [3, 3, C, C] and bias [C] (float64) of the one conv both branches equal.

        The 1x1 kernel is a 3x3 kernel that is zero but at its centre; each norm scales its
        conv's output channels and shifts them, so kernels add and shifts add.
        """
        if not self.conv1.built or not self.conv2.built:
            raise ValueError(f"RepVggBlock {self.name}: fuse() needs built weights; call the "
                             f"model once (or load its weights) first")
        k3, b3 = self.conv1.folded()
        k1, b1 = self.conv2.folded()
        kernel = k3.copy()
        kernel[1, 1] += k1[0, 0]
        return kernel, b3 + b1

    def fuse(self) -> None:
        """Switches to the inference form (see the class docstring); again re-folds."""
        kernel, bias = self.fused_weights()
        if not self.conv.built:
            # Built outside a call, the variables would be plain 'kernel' / 'bias'; under the
            # branches' scope they read '.../bottlenecks.0/conv/kernel'.
            scope = self.conv1.conv.kernel.name.rsplit("conv1/", 1)[0]
            with tf.name_scope(scope), tf.name_scope(self.conv.name):
                self.conv.build([None, None, None, self.channels])
        self.conv.set_weights([kernel.astype(np.float32), bias.astype(np.float32)])
        self.fused = True


class CSPRepLayer(tf_keras.layers.Layer):
    """Cross-stage-partial layer: conv3(bottlenecks(conv1(x)) + conv2(x)).

    conv1 and conv2 are 1x1 conv-norm-acts to `hidden = int(out_channels * hidden_expansion)`
    channels; `bottlenecks` are `num_blocks` RepVGG blocks on that width; conv3 is a 1x1
    conv-norm-act back to `out_channels`, absent (the identity) when the widths agree.
    """

    def __init__(self, out_channels: int, hidden_expansion: float = 1.0, num_blocks: int = 3,
                 activation: Activation = "silu", **kwargs):
        super().__init__(**kwargs)
        hidden = int(out_channels * hidden_expansion)
        self.conv1 = ConvNorm(hidden, 1, activation=activation, name="conv1")
        self.conv2 = ConvNorm(hidden, 1, activation=activation, name="conv2")
        self.bottlenecks = [RepVggBlock(hidden, activation, name=f"bottlenecks.{i}")
                            for i in range(num_blocks)]
        self.conv3 = (ConvNorm(out_channels, 1, activation=activation, name="conv3")
                      if hidden != out_channels else None)

    def call(self, x: tf.Tensor, training: Optional[bool] = None) -> tf.Tensor:
        """[B, H, W, C_in] -> [B, H, W, out_channels]."""
        y = self.conv1(x, training=training)
        for block in self.bottlenecks:
            y = block(y, training=training)
        y = y + self.conv2(x, training=training)
        return self.conv3(y, training=training) if self.conv3 is not None else y

    def fuse(self) -> None:
        """Every RepVGG block to its inference form."""
        for block in self.bottlenecks:
            block.fuse()
