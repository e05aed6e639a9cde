"""ResNet-vd, RT-DETR's backbone, laid out like transformers' RTDetrResNetBackbone.

What sets it apart from the torchvision ResNet of backbone.py:
- A deep stem: three 3x3 conv-BN-ReLU (stride 2, 1, 1; widths e/2, e/2, e with e the
  embedding size), then a 3x3 max-pool with stride 2.
- The "vd" shortcut: a block that halves the resolution takes its shortcut through a 2x2
  average pool (stride 2, ceil mode) and a 1x1 conv with stride 1, instead of a strided 1x1
  conv that would drop three quarters of its input.
- transformers' stride and shortcut placement, kept even where it looks odd (see `_shortcut`):
  ResNet-18/34 give the first block of every stage a projected shortcut, stage 1's included.
- Batch norms frozen by default, as RT-DETR replaces them with frozen ones.

Torch's geometry is kept on any canvas, odd sizes included: convolutions pad k // 2 on every
side (TorchConv2D), so a stride-2 layer maps n pixels to ceil(n / 2); torch's ceil-mode average
pool does too and averages only the pixels inside the map, which is TF's 'SAME' average pool
(its padding is all at the end and left out of the mean).

Layer names are transformers' module names (`embedder.embedder.0`, `encoder.stages.1.layers.0`,
`layer.2`, `shortcut.1`, `convolution`, `normalization`), so a variable's path reads like its
state-dict key; `detr_tf.weights.rtdetr.backbone.hf_targets` maps them.
"""
from typing import Iterator, List, Optional, Sequence, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling.backbone import NORMS, TorchConv2D, conv_norm, make_norm

# depth -> (block kind, blocks per stage), as transformers' configs of the RT-DETR checkpoints.
DEPTHS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)),
          50: ("bottleneck", (3, 4, 6, 3)), 101: ("bottleneck", (3, 4, 23, 3))}
# Stage output widths per block kind (transformers' hidden_sizes).
WIDTHS = {"basic": (64, 128, 256, 512), "bottleneck": (256, 512, 1024, 2048)}


class ConvNorm(tf_keras.layers.Layer):
    """Conv (torch padding, no bias) -> batch norm -> optional ReLU: transformers'
    RTDetrResNetConvLayer (`convolution`, `normalization`), or its ShortCut without the ReLU."""

    def __init__(self, filters: int, kernel_size: int, stride: int = 1, relu: bool = True,
                 norm: str = "frozen", **kwargs):
        super().__init__(**kwargs)
        self.convolution = TorchConv2D(filters, kernel_size, stride, name="convolution")
        self.normalization = make_norm(norm, "normalization")
        self.relu = relu

    def call(self, x: tf.Tensor) -> tf.Tensor:
        """[B, h, w, C] -> [B, ceil(h / stride), ceil(w / stride), filters]."""
        x = conv_norm(self.convolution, self.normalization, x)
        return tf.nn.relu(x) if self.relu else x


def _shortcut(kind: str, first: bool, in_ch: int, out_ch: int, stride: int) -> str:
    """transformers' shortcut of a block: 'identity', 'conv' (a 1x1 conv with the block's stride,
    then BN) or 'pool' (the vd shortcut: 2x2 average pool, then a 1x1 conv with stride 1 and BN).

    A basic stage's first block always projects: through the pool when the width changes (even
    at stride 1, which transformers cannot run, see ResNetVd), else through a strided 1x1 conv.
    A bottleneck pools whenever it has stride 2, and projects at stride 1 when the width changes.
    """
    if kind == "basic":
        if not first:
            return "identity"
        return "pool" if in_ch != out_ch else "conv"
    if stride == 2:
        return "pool"
    return "conv" if in_ch != out_ch else "identity"


def _main_path(kind: str, out_ch: int, stride: int,
               downsample_in_bottleneck: bool) -> List[Tuple[int, int, int]]:
    """(filters, kernel, stride) of each conv of a block's residual branch (`layer.k`)."""
    if kind == "basic":
        return [(out_ch, 3, stride), (out_ch, 3, 1)]
    mid = out_ch // 4
    if downsample_in_bottleneck:  # the stride on the first 1x1 conv (ResNet v1)
        return [(mid, 1, stride), (mid, 3, 1), (out_ch, 1, 1)]
    return [(mid, 1, 1), (mid, 3, stride), (out_ch, 1, 1)]  # on the 3x3 (v1.5, RT-DETR's)


class VdBlock(tf_keras.layers.Layer):
    """A residual block: `layer.0` .. `layer.{n-1}` (ReLU after all but the last), plus the
    shortcut (`_shortcut`), then ReLU."""

    def __init__(self, convs: Sequence[Tuple[int, int, int]], shortcut: str = "identity",
                 stride: int = 1, norm: str = "frozen", **kwargs):
        super().__init__(**kwargs)
        self.layer = [ConvNorm(f, k, s, relu=i < len(convs) - 1, norm=norm, name=f"layer.{i}")
                      for i, (f, k, s) in enumerate(convs)]
        out_ch = convs[-1][0]
        self.pool = shortcut == "pool"
        self.shortcut = None
        if shortcut == "pool":  # transformers' Sequential(AvgPool2d, ShortCut): index 1
            self.shortcut = ConvNorm(out_ch, 1, 1, relu=False, norm=norm, name="shortcut.1")
        elif shortcut == "conv":
            self.shortcut = ConvNorm(out_ch, 1, stride, relu=False, norm=norm, name="shortcut")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        """[B, h, w, C_in] -> [B, ceil(h / stride), ceil(w / stride), C_out]."""
        residual = x
        for conv in self.layer:
            x = conv(x)
        if self.pool:
            # torch's AvgPool2d(2, 2, ceil_mode=True): see the module docstring.
            residual = tf.nn.avg_pool2d(residual, 2, 2, "SAME")
        if self.shortcut is not None:
            residual = self.shortcut(residual)
        return tf.nn.relu(x + residual)


def _stage(kind: str, index: int, count: int, in_ch: int, out_ch: int, stride: int,
           downsample_in_bottleneck: bool, norm: str) -> List[VdBlock]:
    """transformers' stage `index`: the first block changes the width and strides, the others
    keep both."""
    blocks = []
    for j in range(count):
        s, c_in = (stride, in_ch) if j == 0 else (1, out_ch)
        blocks.append(VdBlock(_main_path(kind, out_ch, s, downsample_in_bottleneck),
                              _shortcut(kind, j == 0, c_in, out_ch, s), stride=s, norm=norm,
                              name=f"encoder.stages.{index}.layers.{j}"))
    return blocks


@gin.configurable
class ResNetVd(tf_keras.layers.Layer):
    """RT-DETR's ResNet-vd backbone: NHWC images -> [C3, C4, C5] (strides 8, 16, 32).

    Defaults give ResNet-50-vd as the Hub's RT-DETR R50 uses it. The block kind and counts come
    from `depth`; `hidden_sizes`, `embedding_size` and `depths` narrow it (tests build tiny
    ones), with the meaning of transformers' RTDetrResNetConfig fields of the same names.

    Args:
      depth: 18 or 34 (basic blocks), 50 or 101 (bottlenecks).
      hidden_sizes: the four stages' output widths; default (64, 128, 256, 512) for basic
        blocks, (256, 512, 1024, 2048) for bottlenecks. A bottleneck's inner width is 1/4.
      embedding_size: the stem's output width (its first two convs have half of it).
      depths: blocks per stage, overriding `depth`'s (four stages).
      downsample_in_first_stage: stage 1 also halves the resolution (strides 16, 32, 64 out).
      downsample_in_bottleneck: a bottleneck strides on its first 1x1 conv, not the 3x3.
      norm: 'frozen' (RT-DETR's frozen batch norms, eps 1e-5) or 'batch' (trainable ones, as
        transformers has with freeze_backbone_batch_norms=False); see backbone.make_norm.
      train_stem: whether the stem's convs train. The original RT-DETR R50/R101 recipes freeze
        them (freeze_at=0); transformers trains them.

    Attributes:
      out_channels: the widths of C3, C4, C5 (hidden_sizes[1:]).
      strides: their strides, (8, 16, 32) unless downsample_in_first_stage.
    """

    def __init__(self, depth: int = 50, hidden_sizes: Optional[Sequence[int]] = None,
                 embedding_size: int = 64, depths: Optional[Sequence[int]] = None,
                 downsample_in_first_stage: bool = False, downsample_in_bottleneck: bool = False,
                 norm: str = "frozen", train_stem: bool = True, **kwargs):
        kwargs.setdefault("name", "backbone")
        super().__init__(**kwargs)
        if depth not in DEPTHS:
            raise ValueError(f"ResNetVd.depth={depth!r} is not one of {sorted(DEPTHS)}")
        if norm not in NORMS:
            raise ValueError(f"ResNetVd.norm={norm!r} is not one of {NORMS}")
        kind, default_depths = DEPTHS[depth]
        depths = tuple(int(n) for n in (depths or default_depths))
        hidden_sizes = tuple(int(c) for c in (hidden_sizes or WIDTHS[kind]))
        if len(depths) != 4 or min(depths) < 1 or len(hidden_sizes) != 4:
            raise ValueError(f"ResNetVd needs four stages: depths={depths}, "
                             f"hidden_sizes={hidden_sizes}")
        first_stride = 2 if downsample_in_first_stage else 1
        if kind == "basic" and first_stride == 1 and embedding_size != hidden_sizes[0]:
            # transformers would average-pool that block's shortcut but not its main path.
            raise ValueError(f"ResNetVd(depth={depth}): basic blocks need embedding_size == "
                             f"hidden_sizes[0] (got {embedding_size} and {hidden_sizes[0]}) "
                             "unless downsample_in_first_stage=True")
        self.kind = kind
        half = embedding_size // 2
        self.embedder = [ConvNorm(c, 3, s, norm=norm, name=f"embedder.embedder.{i}")
                         for i, (c, s) in enumerate(((half, 2), (half, 1), (embedding_size, 1)))]
        for layer in self.embedder:
            layer.trainable = train_stem
        in_widths = (embedding_size,) + hidden_sizes[:-1]
        self.stages = [
            _stage(kind, i, n, c_in, c_out, first_stride if i == 0 else 2,
                   downsample_in_bottleneck, norm)
            for i, (n, c_in, c_out) in enumerate(zip(depths, in_widths, hidden_sizes))]
        self.out_channels = hidden_sizes[1:]
        s = 4 * first_stride
        self.strides = (2 * s, 4 * s, 8 * s)

    def call(self, images: tf.Tensor, training: Optional[bool] = None) -> List[tf.Tensor]:
        """Runs the network; `training` only matters with norm='batch'.

        Args:
          images: [B, H, W, 3], RT-DETR's input range [0, 1]. The whole canvas is seen (RT-DETR
            has no pixel mask).

        Returns:
          [C3, C4, C5]: [B, H_s, W_s, out_channels[k]] for s in `strides`, H_s = ceil(H / s)
          (each stride-2 step rounds up, as torch's).
        """
        del training  # reaches the batch norms through Keras' call context
        x = images
        for layer in self.embedder:
            x = layer(x)
        # torch pads its max-pool with -inf; zeros give the same maximum after the ReLU, and
        # every window holds a real value.
        x = tf.nn.max_pool2d(tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]]), 3, 2, "VALID")
        features = []
        for stage in self.stages:
            for block in stage:
                x = block(x)
            features.append(x)
        return features[1:]

    def conv_norms(self) -> Iterator[Tuple[str, ConvNorm]]:
        """(transformers module path, layer) of every conv + norm, in state-dict order."""
        for layer in self.embedder:
            yield layer.name, layer
        for stage in self.stages:
            for block in stage:
                subs = ([block.shortcut] if block.shortcut is not None else []) + block.layer
                for sub in subs:
                    yield f"{block.name}.{sub.name}", sub
