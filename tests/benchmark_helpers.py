"""Builds the tiny Gin DETR and its trainer step for benchmark tests."""
import gin

from detr_tf import config
from detr_tf.benchmarks import ours, synthetic


def tiny_train_step(image_size, jit="none", batch_size=2):
    """(TrainStep, synthetic batch, image_size) for models/detr_tiny.gin with 3 classes."""
    gin.clear_config()
    config.parse_gin_config(["models/detr_tiny.gin"], ["NUM_CLASSES=3"], finalize=False)
    from detr_tf.losses import SetCriterion
    from detr_tf.modeling.detr import build_model

    ts = ours.build_train_step(build_model, SetCriterion(), jit)
    batch = synthetic.ours(synthetic.draw(batch_size, image_size, 3, 10, 3))
    gin.clear_config()
    return ts, batch, image_size
