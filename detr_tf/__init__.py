"""detr_tf: DETR object detectors in TensorFlow 2 with XLA-compiled training."""

__version__ = "0.1.0"
