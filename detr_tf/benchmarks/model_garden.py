"""TF Model Garden's DETR (official/projects/detr) train step, built for side-by-side timing.

Model Garden is our point of comparison, at the same model size (ResNet + 6/6
transformer, 100 queries), resolution, batch and precision, fed the same synthetic batch, with
its own task code (`DetectionTask.train_step`: forward, six sequential Hungarian matchings, the
losses, backward, its DETR AdamW with global clipping) wrapped in one `tf.function`.
"""
from typing import Callable, Tuple

import tensorflow as tf
import tf_keras


def import_model_garden() -> None:
    """Imports Model Garden's DETR modules.

    Model Garden registers Gin configurables on import, so this must run before detr_tf's Gin
    configuration is parsed and locked.
    """
    from official.projects.detr import optimization  # noqa: F401
    from official.projects.detr.tasks import detection  # noqa: F401


def build_train_step(image_size: Tuple[int, int], resnet_depth: int = 50,
                     num_queries: int = 100, num_classes: int = 91, num_encoder_layers: int = 6,
                     num_decoder_layers: int = 6, hidden_size: int = 256,
                     jit: bool = False) -> Tuple[Callable, tf_keras.Model]:
    """Builds Model Garden's DETR task, model and optimizer under the current Keras policy.

    Args:
      image_size: (H, W) of the input.
      resnet_depth: Model Garden ResNet model_id (10, 18, 50, 101...).
      jit: compile the whole train step (forward, matching, backward, update) with XLA.

    Returns:
      (step, model): step(images, labels) runs one optimizer step and returns the loss.
    """
    # Imported here so the rest of detr_tf never needs Model Garden.
    from official.projects.detr import optimization
    from official.projects.detr.configs import detr as detr_cfg
    from official.projects.detr.tasks import detection
    from official.vision.configs import backbones

    h, w = image_size
    config = detr_cfg.DetrTask(model=detr_cfg.Detr(
        input_size=[h, w, 3], num_queries=num_queries, num_classes=num_classes,
        hidden_size=hidden_size, num_encoder_layers=num_encoder_layers,
        num_decoder_layers=num_decoder_layers,
        backbone=backbones.Backbone(type="resnet", resnet=backbones.ResNet(
            model_id=resnet_depth, bn_trainable=False))))
    task = detection.DetectionTask(config)
    model = task.build_model()
    # The optimizer of Model Garden's own DETR test and COCO recipe: DETR AdamW, clip 0.1.
    opt_cfg = optimization.OptimizationConfig({
        "optimizer": {"type": "detr_adamw",
                      "detr_adamw": {"weight_decay_rate": 1e-4, "global_clipnorm": 0.1}},
        "learning_rate": {"type": "stepwise",
                          "stepwise": {"boundaries": [120000], "values": [1e-4, 1e-5]}},
    })
    optimizer = detection.DetectionTask.create_optimizer(opt_cfg)
    model(tf.zeros([1, h, w, 3]), training=False)  # variables outside the timed function

    def step(images, labels):
        logs = task.train_step((images, labels), model, optimizer)
        return logs[task.loss]

    return tf.function(step, jit_compile=jit), model
