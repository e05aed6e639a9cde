"""ResNet backbone against a float64 numpy implementation of torchvision's conv semantics."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.modeling.backbone import (BasicBlock, Bottleneck, FrozenBatchNorm, ResNet,
                                       TorchConv2D, torchvision_variables)


# ---------------------------------------------------------------- float64 torch-like reference
def np_conv(x, w, stride=1, pad=0, dilation=1):
    """torch.nn.functional.conv2d semantics (symmetric zero padding) for HWC x, HWIO w."""
    x = np.pad(x, [(pad, pad), (pad, pad), (0, 0)])
    k = w.shape[0]
    span = dilation * (k - 1) + 1
    ho = (x.shape[0] - span) // stride + 1
    wo = (x.shape[1] - span) // stride + 1
    out = np.zeros((ho, wo, w.shape[-1]))
    for a in range(k):
        for b in range(k):
            patch = x[a * dilation:a * dilation + stride * (ho - 1) + 1:stride,
                      b * dilation:b * dilation + stride * (wo - 1) + 1:stride]
            out += patch @ w[a, b]
    return out


def np_maxpool(x):
    """torch max_pool2d(kernel 3, stride 2, padding 1): padding counts as -inf."""
    x = np.pad(x, [(1, 1), (1, 1), (0, 0)], constant_values=-np.inf)
    ho, wo = (x.shape[0] - 3) // 2 + 1, (x.shape[1] - 3) // 2 + 1
    return np.max([x[a:a + 2 * ho - 1:2, b:b + 2 * wo - 1:2]
                   for a in range(3) for b in range(3)], axis=0)


def np_bn(x, bn):
    v = {n: getattr(bn, n).numpy().astype(np.float64)
         for n in ("weight", "bias", "running_mean", "running_var")}
    return (x - v["running_mean"]) / np.sqrt(v["running_var"] + 1e-5) * v["weight"] + v["bias"]


def np_kernel(conv):
    return conv.kernel.numpy().astype(np.float64)


def relu(x):
    return np.maximum(x, 0)


def randomize(layer, rng):
    """Random weights and non-trivial frozen statistics, so the test exercises every term."""
    for v in layer.variables:
        name = v.name.split("/")[-1]
        if name.startswith(("running_var", "weight")):
            value = rng.uniform(0.5, 1.5, v.shape)
        elif name.startswith("kernel"):
            value = rng.normal(0, np.sqrt(2.0 / np.prod(v.shape[:-1])), v.shape)
        else:
            value = rng.normal(0, 0.1, v.shape)
        v.assign(value.astype(np.float32))


# ---------------------------------------------------------------- tests
def test_frozen_batch_norm_formula_and_no_trainable_weights():
    rng = np.random.default_rng(0)
    bn = FrozenBatchNorm()
    x = rng.normal(size=(2, 3, 3, 5)).astype(np.float32)
    bn(x)
    randomize(bn, rng)
    np.testing.assert_allclose(bn(x).numpy(), np_bn(x.astype(np.float64), bn), rtol=1e-5,
                               atol=1e-5)
    assert bn.trainable_weights == []
    assert sorted(v.name.split("/")[-1] for v in bn.weights) == [
        "bias:0", "running_mean:0", "running_var:0", "weight:0"]


@pytest.mark.parametrize("size", [(13, 11), (16, 16)])
def test_stem_matches_torch_padding(size):
    rng = np.random.default_rng(1)
    net = ResNet(block=BasicBlock, layers=(1,), width=4)
    x = rng.normal(size=(1, *size, 3)).astype(np.float32)
    mask = np.ones((1, *size), bool)
    net(x, mask)
    randomize(net, rng)
    want = np_maxpool(relu(np_bn(np_conv(x[0].astype(np.float64), np_kernel(net.conv1), 2, 3),
                                 net.bn1)))
    got = net.stem(x, mask).numpy()[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride,dilation", [(2, 1), (1, 2)])
def test_bottleneck_is_v1_5_with_torch_padding(stride, dilation):
    rng = np.random.default_rng(2)
    blk = Bottleneck(4, stride=stride, dilation=dilation, downsample=True)
    x = rng.normal(size=(1, 9, 7, 8)).astype(np.float32)
    mask = np.ones((1, 9, 7), bool)
    blk(x, mask)
    randomize(blk, rng)
    x64 = x[0].astype(np.float64)
    out = relu(np_bn(np_conv(x64, np_kernel(blk.conv1)), blk.bn1))
    out = relu(np_bn(np_conv(out, np_kernel(blk.conv2), stride, dilation, dilation), blk.bn2))
    out = np_bn(np_conv(out, np_kernel(blk.conv3)), blk.bn3)
    identity = np_bn(np_conv(x64, np_kernel(blk.downsample[0]), stride), blk.downsample[1])
    want = relu(out + identity)
    got = blk(x, mask).numpy()[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_basic_block_matches_reference():
    rng = np.random.default_rng(3)
    blk = BasicBlock(6, stride=2, downsample=True)
    x = rng.normal(size=(1, 7, 10, 3)).astype(np.float32)
    mask = np.ones((1, 7, 10), bool)
    blk(x, mask)
    randomize(blk, rng)
    x64 = x[0].astype(np.float64)
    out = relu(np_bn(np_conv(x64, np_kernel(blk.conv1), 2, 1), blk.bn1))
    out = np_bn(np_conv(out, np_kernel(blk.conv2), 1, 1), blk.bn2)
    identity = np_bn(np_conv(x64, np_kernel(blk.downsample[0]), 2), blk.downsample[1])
    np.testing.assert_allclose(blk(x, mask).numpy()[0], relu(out + identity), rtol=1e-4,
                               atol=1e-4)


def test_resnet50_shapes_trainability_and_torchvision_names():
    net = ResNet()
    feats, mask = net(tf.zeros([1, 64, 96, 3]), tf.ones([1, 64, 96], bool))
    assert feats.shape == (1, 2, 3, 2048) and mask.shape == (1, 2, 3)
    assert net.num_channels == 2048 and net.output_stride == 32
    trainable = {v.ref() for v in net.trainable_variables}
    names = torchvision_variables(net)
    # torchvision resnet50 without fc: 53 convs + 53 batch norms x 4 buffers.
    assert len(names) == 53 + 53 * 4
    assert names["conv1.weight"].shape == (7, 7, 3, 64)
    assert names["layer4.2.conv3.weight"].shape == (1, 1, 512, 2048)
    assert names["layer3.0.downsample.1.running_var"].shape == (1024,)
    for key, var in names.items():
        # As in DETR: only conv weights of layer2..layer4 are trained; batch norms never.
        want = key.startswith(("layer2", "layer3", "layer4")) and "bn" not in key \
            and "downsample.1" not in key
        assert (var.ref() in trainable) == want, key
    # The stride sits on the 3x3 conv (v1.5).
    assert net.stages[1][0].conv1.strides == (1, 1) and net.stages[1][0].conv2.strides == (2, 2)


def test_dc5_dilates_the_last_stage_like_torchvision():
    net = ResNet(dilation=True)
    feats, mask = net(tf.zeros([1, 64, 64, 3]), tf.ones([1, 64, 64], bool))
    assert feats.shape == (1, 4, 4, 2048) and mask.shape == (1, 4, 4)
    assert net.output_stride == 16
    # replace_stride_with_dilation: the first block of layer4 keeps dilation 1.
    assert [(b.conv2.strides, b.conv2.dilation_rate) for b in net.stages[3]] == [
        ((1, 1), (1, 1)), ((1, 1), (2, 2)), ((1, 1), (2, 2))]


def test_tiny_configurations_and_frozen_backbone():
    net = ResNet(block=BasicBlock, layers=(1, 1, 1), width=8, train_backbone=False)
    feats, mask = net(tf.zeros([2, 64, 64, 3]), tf.ones([2, 64, 64], bool))
    assert feats.shape == (2, 4, 4, 32) and net.output_stride == 16
    assert net.trainable_variables == []
    with pytest.raises(ValueError, match="ResNet.layers"):
        ResNet(layers=(3, 4, 6, 3, 3))


def test_real_pixels_do_not_see_the_padding():
    """Features on an image's real area do not depend on the padding around it."""
    rng = np.random.default_rng(4)
    net = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), width=8)
    h, w = 70, 45
    img = rng.normal(size=(h, w, 3)).astype(np.float32)

    def run(canvas_h, canvas_w, pad_value):
        x = np.full((1, canvas_h, canvas_w, 3), pad_value, np.float32)
        x[0, :h, :w] = img
        m = np.zeros((1, canvas_h, canvas_w), bool)
        m[0, :h, :w] = True
        return net(x, m)

    run(96, 64, 0.0)
    randomize(net, rng)
    small, small_mask = run(96, 64, 0.0)
    big, big_mask = run(160, 128, 3.0)  # non-zero padding: only the mask says what is real
    hs, ws = small.shape[1:3]
    np.testing.assert_array_equal(small_mask.numpy(), big_mask.numpy()[:, :hs, :ws])
    real = small_mask.numpy()[0]
    assert real.sum() == 3 * 2  # ceil(70 / 32) x ceil(45 / 32)
    np.testing.assert_allclose(big.numpy()[0, :hs, :ws][real], small.numpy()[0][real],
                               rtol=1e-4, atol=1e-4)


def test_from_scratch_options_train_stem_and_use_batch_norm():
    from detr_tf.modeling.backbone import BasicBlock, ResNet, make_norm

    net = ResNet(block=BasicBlock, layers=(1, 1), width=8, train_stem=True, norm="batch")
    images = tf.random.normal([2, 64, 64, 3])
    net(images, tf.ones([2, 64, 64], tf.bool))
    trainable = {v.ref() for v in net.trainable_variables}
    assert net.conv1.kernel.ref() in trainable  # the stem trains
    assert any(isinstance(layer, tf_keras.layers.BatchNormalization)
               for layer in net._flatten_layers())
    # A batch norm in training mode standardizes each channel over the batch.
    norm = make_norm("batch", "bn")
    x = tf.random.normal([4, 8, 8, 3]) * 5.0 + 3.0
    y = norm(x, training=True).numpy()
    np.testing.assert_allclose(y.mean(axis=(0, 1, 2)), 0.0, atol=1e-4)
    np.testing.assert_allclose(y.std(axis=(0, 1, 2)), 1.0, atol=1e-2)
    # The DETR default stays: frozen stem, frozen norms.
    default = ResNet(block=BasicBlock, layers=(1, 1), width=8)
    default(images, tf.ones([2, 64, 64], tf.bool))
    assert default.conv1.kernel.ref() not in {v.ref() for v in default.trainable_variables}
    with pytest.raises(ValueError, match="ResNet.norm='group'"):
        make_norm("group", "bn")


def test_torch_conv_in_a_graph_with_static_shapes_equals_eager():
    """A padded strided conv traced with static sizes keeps torch's output size (a graph sets
    static shapes that eager execution never checks) and eager's values."""
    conv = TorchConv2D(4, 3, strides=2)
    x = tf.random.stateless_normal([2, 13, 16, 3], [0, 1])
    eager = conv(x)
    graph = tf.function(conv.call)(x)
    assert eager.shape == graph.shape == (2, 7, 8, 4)
    np.testing.assert_array_equal(eager.numpy(), graph.numpy())


def test_batch_norm_on_two_replicas_equals_one_device_with_the_whole_batch():
    """Trainable batch norm under a 2-replica MirroredStrategy (the conftest's two logical CPUs)
    normalizes with the global batch's statistics, and moves its moving mean and (unbiased)
    variance, as Keras's fused layer does on one device given the whole batch; gradients too."""
    from detr_tf.modeling.backbone import batch_norm

    x = np.random.default_rng(0).normal(3.0, 2.0, size=(4, 5, 6, 3)).astype(np.float32)
    upstream = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
    one = batch_norm("bn")
    one.build(x.shape)
    with tf.GradientTape() as tape:
        tape.watch(one.trainable_variables)
        y = one(x, training=True)
        loss = tf.reduce_sum(y * upstream)
    want_grads = tape.gradient(loss, one.trainable_variables)

    # Reduction to one device: no collective keys shared with other tests' strategies.
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        two = batch_norm("bn")
        two.build(x.shape)
    halves = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[2 * ctx.replica_id_in_sync_group:][:2],
                     upstream[2 * ctx.replica_id_in_sync_group:][:2]))

    @tf.function
    def step(per_replica):
        def replica_fn(inputs):
            x_part, up_part = inputs
            with tf.GradientTape() as tape:
                y_part = two(x_part, training=True)
                part = tf.reduce_sum(y_part * up_part)
            grads = tape.gradient(part, two.trainable_variables)
            ctx = tf.distribute.get_replica_context()
            return y_part, ctx.all_reduce("sum", grads)
        return strategy.run(replica_fn, args=(per_replica,))

    y_parts, grads = step(halves)
    got = np.concatenate([t.numpy() for t in strategy.experimental_local_results(y_parts)])
    np.testing.assert_allclose(got, y.numpy(), atol=1e-5)
    for a, b in zip(strategy.experimental_local_results(grads)[0], want_grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(getattr(two, name).numpy(), getattr(one, name).numpy(),
                                   rtol=1e-6, err_msg=name)
    n = 4 * 5 * 6  # the unbiased variance, as torch keeps it
    np.testing.assert_allclose(one.moving_variance.numpy(),
                               0.9 + 0.1 * x.reshape(-1, 3).var(0) * n / (n - 1), rtol=1e-5)
