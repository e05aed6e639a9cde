"""DINO as a recipe (gin_configs/models/dino.gin, docs/MODEL.md "DINO (recipe)"): its new parts
against float64 numpy transcriptions of the official code (IDEA-Research/DINO), the encoder
against Deformable DETR's, and a tiny DINO's training step.

The official functions transcribed: `gen_sineembed_for_position` and the decoder's
`ref_point_head` (models/dino/utils.py, deformable_transformer.py), `sigmoid_focal_loss` and
its use in `SetCriterion.loss_labels` (utils.py, dino.py).
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.losses.focal_class import FocalClassLoss
from detr_tf.modeling.backbone import BasicBlock, ResNet, ResNetLevels, torchvision_variables
from detr_tf.modeling.deformable_detr import build_deformable_detr
from detr_tf.modeling.deformable_transformer import DeformableTransformer
from detr_tf.modeling.dino_encoder import DinoEncoder
from detr_tf.modeling.position_encoding import PositionEmbeddingSine
from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder
from tests import dino_helpers

D = 32  # the tiny models' width


def _decoder(**kwargs) -> RTDetrDecoder:
    return RTDetrDecoder(num_classes=3, d_model=D, num_queries=6, num_layers=2, num_heads=2,
                         dim_feedforward=32, num_points=2, **kwargs)


def _maps(batch=2, shapes=((8, 8), (4, 4), (2, 2)), channels=D, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(size=(batch, h, w, channels)).astype(np.float32))
            for h, w in shapes]


def _reference_boxes(seed=1):
    rng = np.random.default_rng(seed)
    centres = rng.uniform(0.05, 0.95, size=(2, 5, 2))
    sides = rng.uniform(0.01, 0.9, size=(2, 5, 2))
    return np.concatenate([centres, sides], -1)


# --- (a) the sine positional query --------------------------------------------------------

def np_gen_sineembed_for_position(pos, num_pos_feats):
    """DINO's gen_sineembed_for_position (its 128 is d_model / 2) in float64: [..., 4] cx, cy,
    w, h -> [..., 4 * F], the sin / cos interleaved embeddings of y, x, w, h."""
    scale = 2 * np.pi
    dim_t = np.arange(num_pos_feats, dtype=np.float64)
    dim_t = 10000 ** (2 * (dim_t // 2) / num_pos_feats)

    def embed(coord):
        p = coord[..., None] * scale / dim_t
        return np.stack((np.sin(p[..., 0::2]), np.cos(p[..., 1::2])), -1).reshape(
            coord.shape + (num_pos_feats,))

    x, y, w, h = (pos[..., i] for i in range(4))
    return np.concatenate([embed(y), embed(x), embed(w), embed(h)], -1)


def np_mlp(x, layers):
    """DINO's MLP: Linear layers with ReLU between them; layers: [(kernel [in, out], bias)]."""
    for i, (kernel, bias) in enumerate(layers):
        x = x @ kernel.astype(np.float64) + bias.astype(np.float64)
        if i < len(layers) - 1:
            x = np.maximum(x, 0.0)
    return x


def test_sine_query_position_matches_dinos_ref_point_head():
    decoder = _decoder(query_pos="sine")
    decoder(_maps(), training=False)
    boxes = _reference_boxes()
    got = decoder.query_position(tf.constant(boxes, tf.float32)).numpy()
    layers = [(layer.kernel.numpy(), layer.bias.numpy())
              for layer in decoder.query_pos_head.layers]
    assert [k.shape for k, _ in layers] == [(2 * D, D), (D, D)]  # DINO's 2d -> d -> d
    want = np_mlp(np_gen_sineembed_for_position(boxes, D // 2), layers)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_sine_embedding_orders_y_x_w_h():
    # Moving only x must change the second quarter of the embedding, only w the third.
    from detr_tf.modeling.position_encoding import box_sine_embed
    base = np.array([[0.2, 0.3, 0.4, 0.5]])
    moved_x = base + [[0.1, 0, 0, 0]]
    moved_w = base + [[0, 0, 0.1, 0]]
    f = 8
    a, bx, bw = (box_sine_embed(tf.constant(v, tf.float32), f).numpy()
                 for v in (base, moved_x, moved_w))
    changed_x = np.any(a != bx, 0).reshape(4, f).any(1)
    changed_w = np.any(a != bw, 0).reshape(4, f).any(1)
    assert changed_x.tolist() == [False, True, False, False]
    assert changed_w.tolist() == [False, False, True, False]


# --- (e) the default positional query is unchanged ------------------------------------------

def test_default_query_pos_leaves_the_decoder_unchanged():
    features = _maps()
    rng = np.random.default_rng(2)
    dn = {"content": tf.constant(rng.normal(size=(2, 4, D)).astype(np.float32)),
          "anchor_logits": tf.constant(rng.normal(size=(2, 4, 4)).astype(np.float32)),
          "valid": tf.constant([[True, False, True, False], [True, True, True, True]])}
    default, explicit = _decoder(), _decoder(query_pos="mlp")
    default(features, training=False)
    explicit(features, training=False)
    explicit.set_weights(default.get_weights())
    for training, extra in ((False, {}), (True, {"dn": dn, "dn_group_size": 2})):
        a = default(features, training=training, **extra)
        b = explicit(features, training=training, **extra)
        for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
            np.testing.assert_array_equal(x.numpy(), y.numpy())
    # The positional query is still RT-DETR's MLP of the raw box (4 -> 2d -> d), which the
    # sine option replaces.
    boxes = tf.constant(_reference_boxes(), tf.float32)
    assert default.query_pos_head.layers[0].kernel.shape == (4, 2 * D)
    np.testing.assert_array_equal(default.query_position(boxes).numpy(),
                                  default.query_pos_head(boxes).numpy())
    with pytest.raises(ValueError, match="query_pos='box'"):
        _decoder(query_pos="box")


# --- (b) the focal class loss ---------------------------------------------------------------

def np_sigmoid_focal_loss(inputs, targets, num_boxes, alpha=0.25, gamma=2.0):
    """DINO's sigmoid_focal_loss (models/dino/utils.py) in float64: [B, Q, C] -> scalar."""
    prob = 1.0 / (1.0 + np.exp(-inputs))
    ce = np.maximum(inputs, 0) - inputs * targets + np.log1p(np.exp(-np.abs(inputs)))
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss.mean(1).sum() / num_boxes


def np_dino_class_loss(logits, labels, positive, valid, num_boxes):
    """DINO's loss_labels of one layer: one-hot targets of the matched queries (zeros for the
    rest), `sigmoid_focal_loss * Q`. A padded query (valid False) does not exist in DINO, whose
    images have their own query lists: each image is its own batch of its valid queries."""
    total = 0.0
    for b in range(logits.shape[0]):
        keep = valid[b]
        x = logits[b][keep][None].astype(np.float64)
        c = logits.shape[-1]
        # target_classes: the label where matched, else num_classes, one-hot then cut to C.
        classes = np.where(positive[b][keep], labels[b][keep], c)
        onehot = np.eye(c + 1)[classes][:, :c]
        total += np_sigmoid_focal_loss(x, onehot[None], num_boxes) * x.shape[1]
    return total


def test_focal_class_loss_matches_dinos_sigmoid_focal_loss():
    rng = np.random.default_rng(3)
    layers, b, q, c = 2, 2, 7, 5
    logits = (rng.normal(size=(layers, b, q, c)) * 3).astype(np.float32)
    labels = rng.integers(0, c, size=(layers, b, q))
    labels[0, 0, 1] = c  # a negative's "no object" label, ignored as it is not positive
    positive = rng.random((layers, b, q)) < 0.4  # the rest unmatched
    positive[0, 0, 1] = False
    valid = rng.random((layers, b, q)) < 0.8  # the rest padded
    valid[..., 0] = True
    num_boxes = 3.0
    loss = FocalClassLoss()
    assert loss.name == "focal"
    got = loss(tf.constant(logits), None, tf.constant(labels), None, tf.constant(positive),
               tf.constant(num_boxes), [1, 2], tf.constant(valid)).numpy()
    want = [np_dino_class_loss(logits[i], labels[i], positive[i], valid[i], num_boxes)
            for i in range(layers)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # Without query weights every query counts.
    got_all = loss(tf.constant(logits), None, tf.constant(labels), None, tf.constant(positive),
                   tf.constant(num_boxes), [1, 2]).numpy()
    every = np.ones_like(valid)
    np.testing.assert_allclose(got_all, [np_dino_class_loss(logits[i], labels[i], positive[i],
                                                            every[i], num_boxes)
                                         for i in range(layers)], rtol=1e-5)


# --- (c) the encoder ------------------------------------------------------------------------

def test_encoder_equals_deformable_detrs_on_an_unpadded_image():
    """ResNetLevels + DinoEncoder with Deformable DETR's weights give Deformable DETR's memory
    (backbone, input projection, position and level embeddings, encoder layers) on images
    that fill their canvas, where its pixel mask masks nothing."""
    pe = PositionEmbeddingSine(D // 2, temperature=20.0)  # DINO's, DinoEncoder's default
    ddetr = build_deformable_detr(
        num_classes=3, num_queries=4, hidden_dim=D,
        backbone=ResNet(block=BasicBlock, layers=(1, 1, 1, 1), width=8), position_embedding=pe,
        transformer=DeformableTransformer(d_model=D, num_heads=2, num_encoder_layers=2,
                                          num_decoder_layers=1, dim_feedforward=64,
                                          num_levels=4, enc_points=2, dec_points=2))
    images = tf.random.stateless_normal([2, 64, 96, 3], [0, 5])
    mask = tf.ones([2, 64, 96], tf.bool)
    ddetr(images, mask)
    # The attention's offsets and weights start with zero kernels, blind to the queries and so
    # to the position and level embeddings: random kernels make the comparison see them.
    rng = np.random.default_rng(6)
    for layer in ddetr.transformer.encoder_layers:
        for dense in (layer.self_attn.sampling_offsets, layer.self_attn.attention_weights):
            dense.kernel.assign(rng.normal(0, 0.1, dense.kernel.shape))
    src, pos, padding, shapes, ratios = ddetr._features(images, mask, False)
    memory = ddetr.transformer.encode(src, pos, shapes, padding, ratios).numpy()

    backbone = ResNetLevels(block=BasicBlock, layers=(1, 1, 1, 1), width=8)
    encoder = DinoEncoder(d_model=D, num_layers=2, num_heads=2, num_points=2,
                          dim_feedforward=64)
    encoder(backbone(images))
    backbone.set_weights(ddetr.backbone.get_weights())
    encoder.neck.set_weights(ddetr.neck.get_weights())
    encoder.level_embed.assign(ddetr.level_embed)
    for ours, theirs in zip(encoder.layers, ddetr.transformer.encoder_layers):
        ours.set_weights(theirs.get_weights())
    maps = encoder(backbone(images))
    assert [tuple(m.shape[1:3]) for m in maps] == shapes == [(8, 12), (4, 6), (2, 3), (1, 2)]
    flat = np.concatenate([m.numpy().reshape(2, -1, D) for m in maps], 1)
    np.testing.assert_allclose(flat, memory, rtol=1e-4, atol=1e-4)


def test_encoder_gives_its_levels_and_each_image_its_own_result():
    encoder = DinoEncoder(d_model=D, num_layers=1, num_heads=2, num_points=2,
                          dim_feedforward=32)
    features = _maps(3, shapes=((6, 10), (3, 5), (2, 3)), channels=24)
    maps = encoder(features)
    assert encoder.out_channels == (D,) * 4
    # The 4th level is the stride-2 conv of C5 (ceil of half its sides).
    assert [tuple(m.shape) for m in maps] == [(3, 6, 10, D), (3, 3, 5, D), (3, 2, 3, D),
                                              (3, 1, 2, D)]
    # No statistic crosses the batch (GroupNorm per image, attention within an image).
    alone = encoder([f[1:2] for f in features])
    for batched, single in zip(maps, alone):
        np.testing.assert_allclose(batched[1:2].numpy(), single.numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="num_pos_feats"):
        DinoEncoder(d_model=D, position_embedding=PositionEmbeddingSine(D))


# --- (d) a tiny DINO from the recipe's model file -----------------------------------------

@pytest.fixture
def tiny_dino():
    """(model, criterion) of gin_configs/models/dino.gin with tiny sizes."""
    return dino_helpers.assemble(["models/dino.gin"], dino_helpers.TINY)


def _train_step(model, criterion, optimizer, images, mask, targets):
    with tf.GradientTape() as tape:
        losses = criterion(model(images, mask, training=True, targets=targets), targets)
    variables = model.trainable_variables
    grads = tape.gradient(losses["loss"], variables)
    optimizer.apply_gradients(zip(grads, variables))
    return losses, grads


def _check_step(model, criterion, step):
    images, mask, targets = dino_helpers.tiny_batch()
    model(images, mask)  # built, as the trainer builds it before the step
    before = [v.numpy() for v in model.trainable_variables]
    losses, grads = step(model, criterion, tf_keras.optimizers.SGD(0.01), images, mask,
                         targets)
    for key in ("loss_focal", "loss_focal_0", "loss_focal_enc", "loss_bbox_enc",
                "loss_dn_focal", "loss_dn_bbox", "loss_dn_giou_0"):
        assert key in losses and np.isfinite(losses[key].numpy()), key
    assert losses["loss_dn_focal"].numpy() > 0 and losses["loss_focal_enc"].numpy() > 0
    assert np.isfinite(losses["loss"].numpy())
    assert all(g is not None and np.all(np.isfinite(tf.convert_to_tensor(g).numpy()))
               for g in grads)
    after = model.trainable_variables
    assert any(not np.array_equal(a, b.numpy()) for a, b in zip(before, after))


def test_the_model_file_builds_dinos_parts(tiny_dino):
    model, criterion = tiny_dino
    assert isinstance(model.backbone, ResNetLevels) and isinstance(model.encoder, DinoEncoder)
    decoder = model.decoder
    assert decoder.query_pos == "sine" and decoder.weight_embedding is not None
    assert all(proj is None for proj in decoder.decoder_input_proj)  # identity, 4 levels
    assert model.denoising.contrastive and model.denoising.box_noise_scale == 1.0
    assert isinstance(criterion.class_loss, FocalClassLoss)


def test_tiny_dino_trains_one_step(tiny_dino):
    _check_step(*tiny_dino, _train_step)


@pytest.mark.slow
def test_tiny_dino_trains_one_step_under_xla(tiny_dino):
    """The same step compiled whole by XLA (train.jit='step'). Slow: compiling it takes
    minutes on 2 busy cores (`pytest -m slow tests/test_dino.py`)."""
    _check_step(*tiny_dino, tf.function(_train_step, jit_compile=True))


def test_an_imagenet_resnet_file_initialises_the_backbone(tiny_dino, tmp_path):
    """BACKBONE_WEIGHTS (a torchvision ResNet state dict) loads into the recipe's backbone by
    torchvision's names; the encoder, decoder and heads keep their values."""
    from safetensors.numpy import save_file

    from detr_tf.weights.importer import load_pretrained
    model, _ = tiny_dino
    images, mask, _ = dino_helpers.tiny_batch()
    model(images, mask)
    source = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), width=8)
    source(images, mask)
    for v in source.variables:
        v.assign(tf.random.stateless_normal(v.shape, [1, len(v.name)]))
    # torch's layouts; safetensors writes an array's memory as it lies: contiguous copies.
    tensors = {name: np.ascontiguousarray(np.transpose(v.numpy(), (3, 2, 0, 1))
                                          if v.shape.rank == 4 else v.numpy())
               for name, v in torchvision_variables(source).items()}
    path = str(tmp_path / "resnet.safetensors")
    save_file(tensors, path)
    rest = [v.numpy() for v in model.decoder.variables]
    report = load_pretrained(model, path)
    assert report.loaded and all(name.startswith("backbone.") for name in report.loaded)
    ours = torchvision_variables(model.backbone)
    for name, v in torchvision_variables(source).items():
        np.testing.assert_array_equal(ours[name].numpy(), v.numpy(), name)
    for before, v in zip(rest, model.decoder.variables):
        np.testing.assert_array_equal(before, v.numpy())
