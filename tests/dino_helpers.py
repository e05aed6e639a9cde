"""A tiny DINO from gin_configs/models/dino.gin (or a recipe on it) and a small batch, shared by
the DINO-family tests."""
from typing import Sequence, Tuple

import gin
import numpy as np
import tensorflow as tf

from detr_tf import config
from detr_tf import run as run_lib

# The recipe's sizes cut down: 2 + 2 layers of width 32, 8 queries, a 4-stage ResNet of width 8.
TINY = ["NUM_CLASSES = 5", "NUM_QUERIES = 8", "D_MODEL = 32", "ENCODER_LAYERS = 2",
        "DECODER_LAYERS = 2", "DIM_FEEDFORWARD = 64", "NUM_POINTS = 2",
        "ResNet.block = @BasicBlock", "ResNet.layers = (1, 1, 1, 1)", "ResNet.width = 8",
        "build_rtdetr.num_heads = 2", "DinoEncoder.num_heads = 2",
        "DenoisingQueries.num_denoising = 8"]
# What an experiment file (dino_r50_4scale.gin and the recipes on it) also needs: its data and
# weight macros, never read by a model build, and no canvas sizes for the 64 px images.
RECIPE = ["build_rtdetr.canvas_sizes = ()", "COCO_TRAIN_PATTERN = 'unused'",
          "COCO_VAL_PATTERN = 'unused'", "COCO_VAL_ANNOTATIONS = 'unused'",
          "BACKBONE_WEIGHTS = 'unused'"]


def assemble(gin_files: Sequence[str], bindings: Sequence[str]):
    """(model, criterion) of the run the Gin files and bindings assemble; the config cleared."""
    gin.clear_config()
    try:
        config.parse_gin_config(list(gin_files), list(bindings), finalize=False)
        run = run_lib.assemble()
        return run.model_fn(), run.criterion
    finally:
        gin.clear_config()


def tiny_batch() -> Tuple[tf.Tensor, tf.Tensor, dict]:
    """Two 64 x 64 canvases whose images are 64 x 48 (16 columns of padding), with 2 and 1 of 3
    padded targets: (images, pixel_mask, targets)."""
    images = tf.random.stateless_normal([2, 64, 64, 3], [0, 7])
    mask = tf.constant(np.pad(np.ones([2, 64, 48], bool), [[0, 0], [0, 0], [0, 16]]))
    targets = {"labels": tf.constant([[1, 4, 0], [3, 0, 0]]),
               "boxes": tf.constant([[[0.5, 0.5, 0.2, 0.3], [0.3, 0.3, 0.1, 0.1], [0] * 4],
                                     [[0.6, 0.4, 0.3, 0.3], [0] * 4, [0] * 4]], tf.float32),
               "mask": tf.constant([[True, True, False], [True, False, False]])}
    return images, mask, targets
