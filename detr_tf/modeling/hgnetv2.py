"""HGNetV2 (PP-HGNetV2), D-FINE's backbone, laid out like transformers' HGNetV2Backbone.

The network:
- Stem: a 3x3 stride-2 conv, then two branches on its output padded by one zero row and column
  at the bottom/right: a 2x2 max-pool (stride 1), and two 2x2 convs (the second after padding
  once more); the branches are concatenated, then a 3x3 stride-2 conv and a 1x1 conv. Stride 4.
- Four stages, each an optional depthwise 3x3 stride-2 downsample (conv + BN, no activation),
  then HG blocks. A block runs `num_layers` convs in a chain (3x3, or "light": a 1x1 conv + BN
  then a depthwise kxk conv + BN + ReLU), concatenates its input with every conv's output, and
  aggregates them with a 1x1 "squeeze" conv to out/2 channels then a 1x1 "excitation" conv to
  out. Every block but a stage's first adds its input (the residual).
- Every conv is followed by a batch norm; those with a ReLU (all but the light blocks' 1x1 and
  the downsamples) are followed by a learnable affine block (one scalar scale and bias) in the
  variants that use it (B0-B3).

Torch's geometry is kept: each conv pads (kernel - 1) // 2 on every side (0 for the stem's 2x2
convs), so a stride-2 layer maps n pixels to ceil(n / 2).

Layer names are transformers' module names (`embedder.stem1`, `encoder.stages.2.downsample`,
`encoder.stages.2.blocks.0.layers.1.conv2`, `aggregation.0`, `convolution`, `normalization`,
`lab`), so a variable's path reads like its state-dict key; `detr_tf.weights.dfine.backbone`
maps them.
"""
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling.backbone import (NORMS, TorchConv2D, TorchDepthwiseConv2D, conv_norm,
                                      make_norm)


class StageSpec(NamedTuple):
    """One stage, in the order of timm's table and transformers' `stage_*` config lists."""
    in_channels: int
    mid_channels: int
    out_channels: int
    num_blocks: int
    downsample: bool
    light_block: bool
    kernel_size: int
    num_layers: int


def _stages(*rows) -> Tuple[StageSpec, ...]:
    return tuple(StageSpec(*row) for row in rows)


# PP-HGNetV2 B0..B5 as PaddleClas defines them (timm's hgnetv2_b*, transformers' D-FINE
# configs): the stem's (mid, out) widths, the four stages, and whether the learnable affine
# blocks are there. D-FINE uses B0 (N, S), B2 (M), B4 (L) and B5 (X).
PRESETS = {
    "b0": dict(stem_channels=(16, 16), use_lab=True, stages=_stages(
        (16, 16, 64, 1, False, False, 3, 3), (64, 32, 256, 1, True, False, 3, 3),
        (256, 64, 512, 2, True, True, 5, 3), (512, 128, 1024, 1, True, True, 5, 3))),
    "b1": dict(stem_channels=(24, 32), use_lab=True, stages=_stages(
        (32, 32, 64, 1, False, False, 3, 3), (64, 48, 256, 1, True, False, 3, 3),
        (256, 96, 512, 2, True, True, 5, 3), (512, 192, 1024, 1, True, True, 5, 3))),
    "b2": dict(stem_channels=(24, 32), use_lab=True, stages=_stages(
        (32, 32, 96, 1, False, False, 3, 4), (96, 64, 384, 1, True, False, 3, 4),
        (384, 128, 768, 3, True, True, 5, 4), (768, 256, 1536, 1, True, True, 5, 4))),
    "b3": dict(stem_channels=(24, 32), use_lab=True, stages=_stages(
        (32, 32, 128, 1, False, False, 3, 5), (128, 64, 512, 1, True, False, 3, 5),
        (512, 128, 1024, 3, True, True, 5, 5), (1024, 256, 2048, 1, True, True, 5, 5))),
    "b4": dict(stem_channels=(32, 48), use_lab=False, stages=_stages(
        (48, 48, 128, 1, False, False, 3, 6), (128, 96, 512, 1, True, False, 3, 6),
        (512, 192, 1024, 3, True, True, 5, 6), (1024, 384, 2048, 1, True, True, 5, 6))),
    "b5": dict(stem_channels=(32, 64), use_lab=False, stages=_stages(
        (64, 64, 128, 1, False, False, 3, 6), (128, 128, 512, 2, True, False, 3, 6),
        (512, 256, 1024, 5, True, True, 5, 6), (1024, 512, 2048, 2, True, True, 5, 6))),
}
# transformers' names of the maps `out_indices` counts: the stem's output, then each stage's.
STAGE_NAMES = ("stem", "stage1", "stage2", "stage3", "stage4")


class LearnableAffine(tf_keras.layers.Layer):
    """y = scale * x + bias with one learned scalar each (transformers' `lab`): a cheap gain
    that lets each ReLU output be rescaled and shifted."""

    def build(self, input_shape):
        # Shape [1], as torch stores them; they train whatever the batch norms do.
        self.scale = self.add_weight(name="scale", shape=[1], initializer="ones")
        self.bias = self.add_weight(name="bias", shape=[1], initializer="zeros")
        super().build(input_shape)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        return x * tf.cast(self.scale, x.dtype) + tf.cast(self.bias, x.dtype)


class ConvLayer(tf_keras.layers.Layer):
    """transformers' HGNetV2ConvLayer: conv (`convolution`) -> batch norm (`normalization`) ->
    optional ReLU -> learnable affine block (`lab`, only after a ReLU, only if `use_lab`)."""

    def __init__(self, filters: int, kernel_size: int, stride: int = 1,
                 depthwise: bool = False, relu: bool = True, use_lab: bool = False,
                 norm: str = "frozen", **kwargs):
        super().__init__(**kwargs)
        if depthwise:
            self.convolution = TorchDepthwiseConv2D(filters, kernel_size, stride,
                                                    name="convolution")
        else:
            self.convolution = TorchConv2D(filters, kernel_size, stride,
                                           pad=(kernel_size - 1) // 2, name="convolution")
        self.depthwise = depthwise
        self.normalization = make_norm(norm, "normalization")
        self.relu = relu
        self.lab = LearnableAffine(name="lab") if relu and use_lab else None

    def call(self, x: tf.Tensor) -> tf.Tensor:
        """[B, h, w, C] -> [B, h', w', filters]: h' = ceil(h / stride) for odd kernels, h - 1
        for the stem's 2x2 ones."""
        x = conv_norm(self.convolution, self.normalization, x)
        if self.relu:
            x = tf.nn.relu(x)
        return self.lab(x) if self.lab is not None else x


class LightConv(tf_keras.layers.Layer):
    """transformers' HGNetV2ConvLayerLight: a 1x1 conv + BN (`conv1`, no ReLU) then a depthwise
    kxk conv + BN + ReLU (`conv2`)."""

    def __init__(self, filters: int, kernel_size: int, use_lab: bool, norm: str, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = ConvLayer(filters, 1, relu=False, use_lab=use_lab, norm=norm, name="conv1")
        self.conv2 = ConvLayer(filters, kernel_size, depthwise=True, use_lab=use_lab, norm=norm,
                               name="conv2")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        """[B, h, w, C] -> [B, h, w, filters]."""
        return self.conv2(self.conv1(x))

    def conv_layers(self) -> List[ConvLayer]:
        return [self.conv1, self.conv2]


class HGBlock(tf_keras.layers.Layer):
    """transformers' HGNetV2BasicLayer: `layers.{k}` in a chain, the concatenation of the
    block's input and every layer's output, `aggregation.0` (1x1 to out/2) and `aggregation.1`
    (1x1 to out), plus the input when `residual`."""

    def __init__(self, spec: StageSpec, residual: bool, use_lab: bool, norm: str, **kwargs):
        super().__init__(**kwargs)
        mid, k = spec.mid_channels, spec.kernel_size
        if spec.light_block:
            self.layers = [LightConv(mid, k, use_lab, norm, name=f"layers.{i}")
                           for i in range(spec.num_layers)]
        else:
            self.layers = [ConvLayer(mid, k, use_lab=use_lab, norm=norm, name=f"layers.{i}")
                           for i in range(spec.num_layers)]
        out = spec.out_channels
        self.aggregation = [
            ConvLayer(out // 2, 1, use_lab=use_lab, norm=norm, name="aggregation.0"),
            ConvLayer(out, 1, use_lab=use_lab, norm=norm, name="aggregation.1")]
        self.residual = residual

    def call(self, x: tf.Tensor) -> tf.Tensor:
        """[B, h, w, C_in] -> [B, h, w, out_channels]."""
        outputs = [x]
        for layer in self.layers:
            outputs.append(layer(outputs[-1]))
        y = tf.concat(outputs, axis=-1)  # [B, h, w, C_in + num_layers * mid]
        for layer in self.aggregation:
            y = layer(y)
        return y + x if self.residual else y

    def conv_layers(self) -> Iterator[Tuple[str, ConvLayer]]:
        for layer in self.layers:
            if isinstance(layer, LightConv):
                for sub in layer.conv_layers():
                    yield f"{layer.name}.{sub.name}", sub
            else:
                yield layer.name, layer
        for layer in self.aggregation:
            yield layer.name, layer


class Stem(tf_keras.layers.Layer):
    """transformers' HGNetV2Embeddings (`stem1`, `stem2a`, `stem2b`, `stem3`, `stem4`), see the
    module docstring."""

    def __init__(self, mid: int, out: int, use_lab: bool, norm: str, **kwargs):
        super().__init__(**kwargs)
        args = dict(use_lab=use_lab, norm=norm)
        self.stem1 = ConvLayer(mid, 3, 2, name="stem1", **args)
        self.stem2a = ConvLayer(mid // 2, 2, name="stem2a", **args)
        self.stem2b = ConvLayer(mid, 2, name="stem2b", **args)
        self.stem3 = ConvLayer(mid, 3, 2, name="stem3", **args)
        self.stem4 = ConvLayer(out, 1, name="stem4", **args)

    def call(self, images: tf.Tensor) -> tf.Tensor:
        """[B, H, W, 3] -> [B, ceil(ceil(H / 2) / 2), ..., out]."""
        # The bottom/right zero row and column keep both 2x2 branches at the size of stem1's
        # output. Zeros, not -inf, in the pool: the affine block may make values negative,
        # and transformers pads with zeros before pooling.
        pad = [[0, 0], [0, 1], [0, 1], [0, 0]]
        x = tf.pad(self.stem1(images), pad)  # [B, h + 1, w + 1, mid]
        branch = self.stem2b(tf.pad(self.stem2a(x), pad))  # [B, h, w, mid]
        pooled = tf.nn.max_pool2d(x, 2, 1, "VALID")  # [B, h, w, mid]
        x = tf.concat([pooled, branch], axis=-1)
        return self.stem4(self.stem3(x))

    def conv_layers(self) -> List[ConvLayer]:
        return [self.stem1, self.stem2a, self.stem2b, self.stem3, self.stem4]


def _out_indices(out_features: Optional[Sequence[str]],
                 out_indices: Optional[Sequence[int]]) -> Tuple[int, ...]:
    """transformers' choice of returned maps: names from STAGE_NAMES, or their indices."""
    if out_features is not None and out_indices is not None:
        raise ValueError("HGNetV2: give out_features or out_indices, not both "
                         f"(got {list(out_features)} and {list(out_indices)})")
    if out_features is not None:
        unknown = [f for f in out_features if f not in STAGE_NAMES]
        if unknown:
            raise ValueError(f"HGNetV2.out_features={list(out_features)}: {unknown} not in "
                             f"{STAGE_NAMES}")
        return tuple(STAGE_NAMES.index(f) for f in out_features)
    indices = tuple(int(i) for i in (out_indices if out_indices is not None else (2, 3, 4)))
    if not indices or any(i < 0 or i >= len(STAGE_NAMES) for i in indices) or \
            list(indices) != sorted(set(indices)):
        raise ValueError(f"HGNetV2.out_indices={list(indices)}: expected increasing indices "
                         f"in 0..{len(STAGE_NAMES) - 1} (0 the stem, k stage k)")
    return indices


def _check_widths(stem_channels: Sequence[int], stages: Sequence[StageSpec]) -> None:
    """Each stage starts at the width the previous part ends with."""
    if len(stem_channels) != 2 or len(stages) != 4:
        raise ValueError(f"HGNetV2 needs stem_channels=(mid, out) and four stages, got "
                         f"stem_channels={tuple(stem_channels)} and {len(stages)} stages")
    width = stem_channels[1]
    for i, spec in enumerate(stages):
        if spec.in_channels != width:
            raise ValueError(f"HGNetV2 stage {i}: in_channels={spec.in_channels}, but the "
                             f"previous part gives {width} channels")
        if spec.num_blocks < 1 or spec.num_layers < 1:
            raise ValueError(f"HGNetV2 stage {i}: {spec} needs num_blocks, num_layers >= 1")
        width = spec.out_channels


@gin.configurable
class HGNetV2(tf_keras.layers.Layer):
    """D-FINE's HGNetV2 backbone: NHWC images -> the maps `out_indices` chooses.

    A preset gives the widths, depths and kernel sizes of PP-HGNetV2 B0..B5; `stem_channels`,
    `stages` and `use_lab` override them (tests build narrow ones).

    Args:
      preset: 'b0' .. 'b5' (see PRESETS).
      stem_channels: the stem's (mid, out) widths, transformers' stem_channels[1:].
      stages: four StageSpec-like rows (in, mid, out, blocks, downsample, light_block,
        kernel_size, layers), as timm's table; transformers' `stage_*` lists column-wise.
      use_lab: whether the learnable affine blocks are there (the preset's by default).
      out_indices: which maps to return, 0 the stem's output and k stage k's (transformers'
        numbering; D-FINE takes (2, 3, 4), its N model (3, 4)).
      out_features: the same by name ('stem', 'stage1' .. 'stage4'); not with out_indices.
      norm: 'frozen' (the D-FINE L/X recipes and transformers' default
        freeze_backbone_batch_norms) or 'batch' (trainable, as the N/S/M recipes); see
        backbone.make_norm.
      train_stem: whether the stem's convs (and affine blocks) train; D-FINE's L and X
        recipes freeze the stem.

    Attributes:
      out_channels: the widths of the returned maps.
      strides: their strides.
    """

    def __init__(self, preset: str = "b4", stem_channels: Optional[Sequence[int]] = None,
                 stages: Optional[Sequence[Sequence]] = None, use_lab: Optional[bool] = None,
                 out_indices: Optional[Sequence[int]] = None,
                 out_features: Optional[Sequence[str]] = None, norm: str = "frozen",
                 train_stem: bool = True, **kwargs):
        kwargs.setdefault("name", "backbone")
        super().__init__(**kwargs)
        if preset not in PRESETS:
            raise ValueError(f"HGNetV2.preset={preset!r} is not one of {sorted(PRESETS)}")
        if norm not in NORMS:
            raise ValueError(f"HGNetV2.norm={norm!r} is not one of {NORMS}")
        base = PRESETS[preset]
        stem_channels = tuple(int(c) for c in (stem_channels or base["stem_channels"]))
        stages = tuple(StageSpec(*row) for row in (stages or base["stages"]))
        use_lab = base["use_lab"] if use_lab is None else bool(use_lab)
        _check_widths(stem_channels, stages)
        self.out_indices = _out_indices(out_features, out_indices)
        self.stem = Stem(*stem_channels, use_lab=use_lab, norm=norm, name="embedder")
        self.stem.trainable = train_stem
        self.downsamples, self.blocks = [], []
        for i, spec in enumerate(stages):
            # As transformers (and timm), the downsample never has a ReLU, so no affine block.
            self.downsamples.append(
                ConvLayer(spec.in_channels, 3, 2, depthwise=True, relu=False, norm=norm,
                          name=f"encoder.stages.{i}.downsample") if spec.downsample else None)
            self.blocks.append([HGBlock(spec, residual=j > 0, use_lab=use_lab, norm=norm,
                                        name=f"encoder.stages.{i}.blocks.{j}")
                                for j in range(spec.num_blocks)])
        widths = (stem_channels[1],) + tuple(s.out_channels for s in stages)
        strides = [4]
        for spec in stages:
            strides.append(strides[-1] * (2 if spec.downsample else 1))
        self.out_channels = tuple(widths[i] for i in self.out_indices)
        self.strides = tuple(strides[i] for i in self.out_indices)

    def call(self, images: tf.Tensor, training: Optional[bool] = None) -> List[tf.Tensor]:
        """Runs the network; `training` only matters with norm='batch'.

        Args:
          images: [B, H, W, 3] as the detector hands them on (D-FINE's input range [0, 1];
            the model, not the backbone, owns the pixel convention). No pixel mask: the whole
            canvas is seen.

        Returns:
          One map per out_indices: [B, H_s, W_s, out_channels[k]] for s = strides[k],
          H_s = ceil(H / s) (each stride-2 layer rounds up, as torch's).
        """
        del training  # reaches the batch norms through Keras' call context
        x = self.stem(images)
        maps = [x]
        for downsample, blocks in zip(self.downsamples, self.blocks):
            if downsample is not None:
                x = downsample(x)
            for block in blocks:
                x = block(x)
            maps.append(x)
        return [maps[i] for i in self.out_indices]

    def conv_layers(self) -> Iterator[Tuple[str, ConvLayer]]:
        """(transformers module path, layer) of every conv + norm (+ affine block)."""
        for layer in self.stem.conv_layers():
            yield f"{self.stem.name}.{layer.name}", layer
        for downsample, blocks in zip(self.downsamples, self.blocks):
            if downsample is not None:
                yield downsample.name, downsample
            for block in blocks:
                for path, layer in block.conv_layers():
                    yield f"{block.name}.{path}", layer
