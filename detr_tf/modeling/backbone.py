"""ResNet backbones for DETR, laid out like torchvision's so its weights can be loaded 1:1.

What makes the numbers match torchvision (and so the reference DETR):
- v1.5 bottlenecks: the stride sits on the 3x3 conv, not on the first 1x1.
- Explicit symmetric zero padding (k // 2 * dilation on every side) followed by a 'valid' conv.
  TF's 'same' pads asymmetrically (more at the bottom/right) for stride 2, which shifts the
  sampling grid by one pixel relative to torchvision.
- Frozen batch norm with epsilon 1e-5, every statistic and affine parameter fixed.
- Layer names follow torchvision's state-dict keys (`conv1`, `bn1`, `layer2.0.conv2`,
  `layer2.0.downsample.0`, ...), see `torchvision_variables`.

Padding invariance. Images in a batch are padded at the bottom/right to a common size. The
pixel mask is downsampled to every resolution (`mask[:, ::s, ::s]`) and padded positions are set
to zero before every conv or pool with a spatial extent larger than 1. So the features on an
image's real pixels equal those of the image run on its own, whatever padding the batch adds
(the reference DETR lets border features see the neighbouring padding). For an unpadded image
the two computations are identical.
"""
from typing import Dict, List, Optional, Sequence, Tuple, Type

import gin
import tensorflow as tf
import tf_keras


@gin.configurable
class FrozenBatchNorm(tf_keras.layers.Layer):
    """Batch norm with fixed statistics and affine parameters (none of them trainable).

    y = (x - running_mean) / sqrt(running_var + epsilon) * weight + bias, per channel (last axis).
    Variable names match torchvision's BatchNorm2d buffers.
    """

    def __init__(self, epsilon: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape):
        c = int(input_shape[-1])
        for name, init in (("weight", "ones"), ("bias", "zeros"),
                           ("running_mean", "zeros"), ("running_var", "ones")):
            # autocast=False: the scale and shift are folded in float32 under any policy.
            setattr(self, name, self.add_weight(name=name, shape=[c], initializer=init,
                                                trainable=False, dtype=tf.float32,
                                                autocast=False))
        super().build(input_shape)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        scale, shift = self.scale_and_shift()
        return x * tf.cast(scale, x.dtype) + tf.cast(shift, x.dtype)

    def scale_and_shift(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """The norm as one per-channel scale and shift, folded in float32."""
        scale = self.weight * tf.math.rsqrt(self.running_var + self.epsilon)
        return scale, self.bias - self.running_mean * scale

    def after(self, conv: "TorchConv2D", x: tf.Tensor) -> tf.Tensor:
        """self(conv(x)) as conv(x) with kernel * scale, plus the shift as a bias.

        The scale moves from the activations (a full multiply forward and backward) onto the
        kernel, and grappler's remapper can fuse the convolution with the bias add and a
        following ReLU. Equal to self(conv(x)) up to float rounding.
        """
        if not self.built:  # as __call__ would, under this layer's name
            with tf.name_scope(self._name_scope()):  # noqa: SLF001
                self._maybe_build(tf.TensorSpec([None, None, None, conv.filters]))  # noqa: SLF001
        scale, shift = self.scale_and_shift()
        y = conv(x, kernel_scale=scale)
        return tf.nn.bias_add(y, tf.cast(shift, y.dtype))


def conv_norm(conv: "TorchConv2D", norm: tf_keras.layers.Layer, x: tf.Tensor) -> tf.Tensor:
    """norm(conv(x)); a frozen norm is folded into the convolution (`FrozenBatchNorm.after`)."""
    if isinstance(norm, FrozenBatchNorm):
        return norm.after(conv, x)
    return norm(conv(x))


NORMS = ("frozen", "batch")


def make_norm(kind: str, name: str) -> tf_keras.layers.Layer:
    """'frozen': DETR's FrozenBatchNorm (for pretrained weights); 'batch': a trainable batch norm
    with batch statistics (`batch_norm`), for a backbone trained from scratch
    (identity-initialised frozen norms would leave such a network with no normalization)."""
    if kind == "frozen":
        return FrozenBatchNorm(name=name)
    if kind == "batch":
        return batch_norm(name)
    raise ValueError(f"ResNet.norm={kind!r} is not one of {NORMS}")


def batch_norm(name: str) -> "BatchNorm":
    """A trainable batch norm with torch's BatchNorm2d defaults: epsilon 1e-5, momentum 0.1
    (Keras counts it the other way: 0.9). See `BatchNorm`."""
    return BatchNorm(epsilon=1e-5, momentum=0.9, name=name)


class BatchNorm(tf_keras.layers.BatchNormalization):
    """Keras's batch norm, with the statistics of the global batch across tf.distribute replicas.

    In training, under a strategy of several replicas (Mirrored, MultiWorkerMirrored), the mean
    and variance are those of every replica's positions together, as torch's SyncBatchNorm
    (RT-DETR's reference trains with it), so that N replicas train like one device with the
    whole batch: the sums, then the squared deviations from the global mean, all-reduced (two
    passes, as exact as the one-device op). The moving variance moves by the unbiased variance
    (x n / (n - 1)), as Keras's fused one-device op and torch do. On one replica and in
    inference it is Keras's own (fused) layer. Horovod runs one process per device, each its own
    replica: there each process normalizes with its own part of the batch.
    """

    # Its training-mode call all-reduces across tf.distribute replicas (read by the train step).
    synchronizes_replicas = True

    def call(self, inputs, training=None):
        context = tf.distribute.get_replica_context()
        static = None if training is None else tf.get_static_value(training)
        if not static or context is None or context.num_replicas_in_sync == 1:
            return super().call(inputs, training=training)
        x = tf.cast(inputs, self.moving_mean.dtype)  # float32 statistics in mixed precision
        axes = list(range(len(x.shape) - 1))
        count = tf.cast(tf.reduce_prod(tf.shape(x)[:-1]), x.dtype)
        total, n = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                      [tf.reduce_sum(x, axes), count])
        mean = total / n  # [C]
        squares = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                     tf.reduce_sum(tf.square(x - mean), axes))
        variance = squares / n
        unbiased = squares / tf.maximum(n - 1.0, 1.0)
        for moving, value in ((self.moving_mean, mean), (self.moving_variance, unbiased)):
            moving.assign_sub((moving - tf.stop_gradient(value)) * (1.0 - self.momentum))
        y = tf.nn.batch_normalization(x, mean, variance, self.beta, self.gamma, self.epsilon)
        return tf.cast(y, inputs.dtype)


class TorchConv2D(tf_keras.layers.Conv2D):
    """Conv2D without bias with torch's symmetric padding `dilation * (kernel // 2)`, or `pad`
    pixels on every side when given (HGNetV2's 2x2 stem convs pad (kernel - 1) // 2 = 0)."""

    def __init__(self, filters: int, kernel_size: int, strides: int = 1, dilation: int = 1,
                 pad: Optional[int] = None, **kwargs):
        super().__init__(filters, kernel_size, strides=strides, dilation_rate=dilation,
                         padding="valid", use_bias=False,
                         kernel_initializer=tf_keras.initializers.VarianceScaling(
                             2.0, "fan_out", "untruncated_normal"), **kwargs)
        self._pad = dilation * (kernel_size // 2) if pad is None else pad

    def compute_output_shape(self, input_shape):
        # Keras sizes (and, when building, validates) a 'valid' conv of the unpadded input,
        # which rejects a 3x3 conv on a 1x1 map; `call` pads first.
        shape = tf.TensorShape(input_shape).as_list()
        for axis in (1, 2):
            if shape[axis] is not None:
                shape[axis] += 2 * self._pad
        return super().compute_output_shape(tf.TensorShape(shape))

    def call(self, x: tf.Tensor, kernel_scale: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Pads, then convolves; with kernel_scale ([filters]), by the kernel times it."""
        if self._pad:
            p = self._pad
            x = tf.pad(x, [[0, 0], [p, p], [p, p], [0, 0]])
        # Not Conv2D.call: in a graph it sets the output's static shape from
        # compute_output_shape, which (above) sizes the unpadded input.
        if kernel_scale is None:
            return self.convolution_op(x, self.kernel)
        return self.convolution_op(x, self.kernel * tf.cast(kernel_scale, self.kernel.dtype))


class TorchDepthwiseConv2D(tf_keras.layers.Layer):
    """A depthwise conv without bias (torch's Conv2d with groups = channels), padding
    (kernel - 1) // 2 on every side. Kernel [k, k, channels, 1]."""

    def __init__(self, channels: int, kernel_size: int, strides: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.filters = channels  # what FrozenBatchNorm.after builds itself for
        self.kernel_size = kernel_size
        self.strides = strides

    def build(self, input_shape):
        k = self.kernel_size
        self.kernel = self.add_weight(
            name="kernel", shape=[k, k, self.filters, 1],
            initializer=tf_keras.initializers.VarianceScaling(2.0, "fan_out",
                                                              "untruncated_normal"))
        super().build(input_shape)

    def call(self, x: tf.Tensor, kernel_scale: Optional[tf.Tensor] = None) -> tf.Tensor:
        """[B, h, w, C] -> [B, ceil(h / s), ceil(w / s), C] (odd kernels); with kernel_scale
        ([C]), by the kernel times it."""
        p = (self.kernel_size - 1) // 2
        if p:
            x = tf.pad(x, [[0, 0], [p, p], [p, p], [0, 0]])
        kernel = tf.cast(self.kernel, x.dtype)
        if kernel_scale is not None:
            kernel = kernel * tf.cast(kernel_scale, x.dtype)[:, None]
        s = self.strides
        return tf.nn.depthwise_conv2d(x, kernel, [1, s, s, 1], "VALID")


def downsample_mask(pixel_mask: tf.Tensor, stride: int) -> tf.Tensor:
    """Mask of a feature map at `stride`: [B, H, W] bool -> [B, ceil(H/s), ceil(W/s)] bool.

    Feature position i covers input pixel s * i, which is real iff s * i < h; this is what
    DETR's nearest-neighbour interpolation gives when H is a multiple of s.
    """
    return pixel_mask[:, ::stride, ::stride]


def _zero_padding(x: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """x: [B, h, w, C], mask: [B, h, w] bool -> x with padded positions set to 0."""
    return x * tf.cast(mask, x.dtype)[..., None]


@gin.configurable
class BasicBlock(tf_keras.layers.Layer):
    """ResNet-18/34 block: 3x3 (stride) -> 3x3, identity or 1x1 projection shortcut."""

    expansion = 1

    def __init__(self, planes: int, stride: int = 1, dilation: int = 1,
                 first_dilation: Optional[int] = None, downsample: bool = False,
                 norm: str = "frozen", **kwargs):
        super().__init__(**kwargs)
        d1 = first_dilation or dilation
        self.conv1 = TorchConv2D(planes, 3, stride, d1, name="conv1")
        self.bn1 = make_norm(norm, "bn1")
        self.conv2 = TorchConv2D(planes, 3, 1, dilation, name="conv2")
        self.bn2 = make_norm(norm, "bn2")
        self.stride = stride
        self.downsample = None
        if downsample:
            self.downsample = [TorchConv2D(planes, 1, stride, name="downsample.0"),
                               make_norm(norm, "downsample.1")]

    def call(self, x: tf.Tensor, mask_in: tf.Tensor) -> tf.Tensor:
        """x: [B, h, w, C_in], mask_in: [B, h, w] bool -> [B, h/stride, w/stride, planes]."""
        out = tf.nn.relu(conv_norm(self.conv1, self.bn1, _zero_padding(x, mask_in)))
        out = _zero_padding(out, downsample_mask(mask_in, self.stride))
        out = conv_norm(self.conv2, self.bn2, out)
        identity = x
        if self.downsample is not None:
            identity = conv_norm(*self.downsample, x)
        return tf.nn.relu(out + identity)


@gin.configurable
class Bottleneck(tf_keras.layers.Layer):
    """ResNet v1.5 bottleneck: 1x1 -> 3x3 (stride, dilation) -> 1x1 (4x planes)."""

    expansion = 4

    def __init__(self, planes: int, stride: int = 1, dilation: int = 1,
                 first_dilation: Optional[int] = None, downsample: bool = False,
                 norm: str = "frozen", **kwargs):
        super().__init__(**kwargs)
        del first_dilation  # Only the 3x3 conv is dilated; it uses `dilation`.
        self.conv1 = TorchConv2D(planes, 1, name="conv1")
        self.bn1 = make_norm(norm, "bn1")
        self.conv2 = TorchConv2D(planes, 3, stride, dilation, name="conv2")
        self.bn2 = make_norm(norm, "bn2")
        self.conv3 = TorchConv2D(planes * 4, 1, name="conv3")
        self.bn3 = make_norm(norm, "bn3")
        self.downsample = None
        if downsample:
            self.downsample = [TorchConv2D(planes * 4, 1, stride, name="downsample.0"),
                               make_norm(norm, "downsample.1")]

    def call(self, x: tf.Tensor, mask_in: tf.Tensor) -> tf.Tensor:
        """x: [B, h, w, C_in], mask_in: [B, h, w] bool -> [B, h/stride, w/stride, 4*planes]."""
        out = tf.nn.relu(conv_norm(self.conv1, self.bn1, x))
        out = tf.nn.relu(conv_norm(self.conv2, self.bn2, _zero_padding(out, mask_in)))
        out = conv_norm(self.conv3, self.bn3, out)
        identity = x
        if self.downsample is not None:
            identity = conv_norm(*self.downsample, x)
        return tf.nn.relu(out + identity)


@gin.configurable
class ResNet(tf_keras.layers.Layer):
    """ResNet feature extractor (no classifier) returning the last stage and its mask.

    Defaults give ResNet-50. ResNet-101: layers=(3, 4, 23, 3). ResNet-18/34: block=BasicBlock,
    layers=(2, 2, 2, 2) / (3, 4, 6, 3). A CPU-sized net: block=BasicBlock, layers=(1, 1, 1, 1),
    width=16 (or fewer stages, e.g. layers=(1, 1, 1), output stride 16).

    As in DETR, the stem and layer1 are never trained and all batch norms are frozen; with
    train_backbone=False nothing is trained.

    Args:
      block: BasicBlock or Bottleneck (a class, e.g. Gin `@Bottleneck`).
      layers: blocks per stage, 1 to 4 stages.
      width: channels of the stem and of stage 1 (planes double per stage).
      dilation: DC5; the last stage uses dilation 2 instead of stride 2.
      train_backbone: whether layer2 onwards are trainable.
      train_stem: also train the stem and layer1 (DETR freezes them because they come
        pretrained; a backbone trained from scratch needs them).
      norm: 'frozen' (DETR, torchvision-compatible) or 'batch' (trainable batch norm, for a
        backbone trained from scratch), see `make_norm`.
      stem_width: channels of the stem alone (default: `width`); timm's narrow ResNets keep a
        64-channel stem whatever their stage widths (the weight-import fixtures use one).
    """

    def __init__(self, block: Type[tf_keras.layers.Layer] = Bottleneck,
                 layers: Sequence[int] = (3, 4, 6, 3), width: int = 64, dilation: bool = False,
                 train_backbone: bool = True, train_stem: bool = False, norm: str = "frozen",
                 stem_width: Optional[int] = None, **kwargs):
        kwargs.setdefault("name", "backbone")
        super().__init__(**kwargs)
        layers = tuple(int(n) for n in layers)
        if not 1 <= len(layers) <= 4 or min(layers) < 1:
            raise ValueError(f"ResNet.layers must hold 1 to 4 positive block counts, got {layers}")
        if dilation and len(layers) < 2:
            raise ValueError("ResNet.dilation (DC5) needs at least 2 stages")
        stem_width = stem_width or width
        self.conv1 = TorchConv2D(stem_width, 7, 2, name="conv1")
        self.bn1 = make_norm(norm, "bn1")
        self.conv1.trainable = train_backbone and train_stem
        self.stages = []
        self._strides = []  # stride of each stage's first block
        in_ch, cur_dilation = stem_width, 1
        output_stride = 4
        for i, n in enumerate(layers):
            planes = width * 2 ** i
            stride = 1 if i == 0 else 2
            prev_dilation = cur_dilation
            if dilation and i == len(layers) - 1:
                # torchvision's replace_stride_with_dilation: the first block keeps the
                # previous dilation, the following ones use the doubled one.
                cur_dilation *= stride
                stride = 1
            output_stride *= stride
            out_ch = planes * block.expansion
            stage = []
            for j in range(n):
                stage.append(block(
                    planes,
                    stride=stride if j == 0 else 1,
                    dilation=prev_dilation if j == 0 else cur_dilation,
                    first_dilation=prev_dilation,
                    downsample=(j == 0 and (stride != 1 or in_ch != out_ch)),
                    norm=norm, name=f"layer{i + 1}.{j}"))
                in_ch = out_ch
            for b in stage:
                b.trainable = train_backbone and (i > 0 or train_stem)
            self.stages.append(stage)
            self._strides.append(stride)
        self.num_channels = in_ch
        self.stage_channels = [width * 2 ** i * block.expansion for i in range(len(layers))]
        self.output_stride = output_stride
        self.dilation = bool(dilation)

    def stem(self, images: tf.Tensor, pixel_mask: tf.Tensor) -> tf.Tensor:
        """conv1 7x7/2 -> bn1 -> ReLU -> max-pool 3x3/2: [B, H, W, 3] -> [B, H/4, W/4, width]."""
        x = tf.nn.relu(conv_norm(self.conv1, self.bn1, _zero_padding(images, pixel_mask)))
        # The max-pool pads with zeros rather than torch's -inf: its input is >= 0 after the
        # ReLU and every window holds a real value, so the maximum is the same.
        x = tf.pad(_zero_padding(x, downsample_mask(pixel_mask, 2)),
                   [[0, 0], [1, 1], [1, 1], [0, 0]])
        return tf.nn.max_pool2d(x, 3, 2, "VALID")

    def call(self, images: tf.Tensor, pixel_mask: tf.Tensor, all_stages: bool = False):
        """Runs the network on a padded batch.

        Args:
          images: [B, H, W, 3] float, ImageNet-normalized.
          pixel_mask: [B, H, W] bool, True on real pixels.
          all_stages: return every stage's output (multi-scale models such as Deformable DETR
            pick C3-C5 from them), not only the last.

        Returns:
          features: [B, H/s, W/s, num_channels] with s = output_stride (32, or 16 with DC5).
          mask: [B, H/s, W/s] bool, True on real positions.
          With all_stages, a list with one (features, mask) pair per stage instead, stage 1
          first (strides 4, 8, 16, 32 without DC5; channels `stage_channels`).
        """
        pixel_mask = tf.cast(pixel_mask, tf.bool)
        x = self.stem(images, pixel_mask)
        stride = 4
        outputs = []
        for stage, first_stride in zip(self.stages, self._strides):
            for j, blk in enumerate(stage):
                x = blk(x, downsample_mask(pixel_mask, stride))
                if j == 0:
                    stride *= first_stride
            outputs.append((x, downsample_mask(pixel_mask, stride)))
        return outputs if all_stages else outputs[-1]


@gin.configurable
class ResNetLevels(ResNet):
    """A ResNet as RT-DETR's builder takes its backbone: `images -> [C3, C4, C5]`.

    No pixel mask: every pixel of the canvas counts as real (RT-DETR's contract, see
    rtdetr.py), which is what torchvision's ResNet computes on a zero-padded batch, and what
    DINO's backbone does. The variables are the ResNet's (torchvision names, the same
    weight files, `torchvision_variables`).

    Args:
      num_levels: how many of the last stages to return (3: C3-C5, strides 8, 16, 32).
      **kwargs: ResNet's (its Gin bindings apply too); DC5 is not supported.
    """

    def __init__(self, num_levels: int = 3, **kwargs):
        super().__init__(**kwargs)
        if not 1 <= num_levels <= len(self.stages):
            raise ValueError(f"ResNetLevels: num_levels={num_levels} must be in "
                             f"[1, {len(self.stages)}] (the ResNet's stages)")
        if self.output_stride != 2 ** (len(self.stages) + 1):
            raise ValueError("ResNetLevels: a dilated (DC5) ResNet is not supported; set "
                             "ResNet.dilation = False")
        self.num_levels = num_levels
        all_strides = [4 * 2 ** i for i in range(len(self.stages))]
        self.strides = tuple(all_strides[-num_levels:])  # RTDETR.build_size reads them
        self.out_channels = tuple(self.stage_channels[-num_levels:])

    def call(self, images: tf.Tensor, training=None) -> List[tf.Tensor]:
        """[B, H, W, 3] ImageNet-normalized -> num_levels maps [B, H/s, W/s, C_s], finest
        first."""
        del training  # frozen norms; a trainable BatchNormalization reads Keras's context
        mask = tf.ones(tf.shape(images)[:3], tf.bool)
        stages = super().call(images, mask, all_stages=True)
        return [x for x, _ in stages[-self.num_levels:]]


def torchvision_variables(backbone: ResNet) -> Dict[str, tf.Variable]:
    """Maps torchvision state-dict keys to this backbone's variables, for loading weights.

    Conv kernels here are [kh, kw, in, out]; torch's are [out, in, kh, kw], so a loader assigns
    `np.transpose(w, (2, 3, 1, 0))`. Batch-norm vectors load as they are (into a trainable
    BatchNormalization's gamma, beta and moving statistics with norm='batch').

    Returns:
      {'conv1.weight': kernel, 'bn1.running_mean': ..., 'layer1.0.conv1.weight': ..., ...};
      the backbone must have been built (called once).
    """
    out = {}

    def add(prefix, layer):
        if isinstance(layer, FrozenBatchNorm):
            for name in ("weight", "bias", "running_mean", "running_var"):
                out[f"{prefix}{layer.name}.{name}"] = getattr(layer, name)
        elif isinstance(layer, tf_keras.layers.BatchNormalization):
            for name, attr in (("weight", "gamma"), ("bias", "beta"),
                               ("running_mean", "moving_mean"),
                               ("running_var", "moving_variance")):
                out[f"{prefix}{layer.name}.{name}"] = getattr(layer, attr)
        else:
            out[f"{prefix}{layer.name}.weight"] = layer.kernel

    add("", backbone.conv1)
    add("", backbone.bn1)
    for stage in backbone.stages:
        for blk in stage:
            for sub in (blk.conv1, blk.bn1, blk.conv2, blk.bn2,
                        getattr(blk, "conv3", None), getattr(blk, "bn3", None),
                        *(blk.downsample or [])):
                if sub is not None:
                    add(blk.name + ".", sub)
    return out
