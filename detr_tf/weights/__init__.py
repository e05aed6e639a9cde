"""Pretrained weights into detr_tf models: reference DETR, Hugging Face DETR, ImageNet ResNet
and detr_tf checkpoints (docs/WEIGHTS.md)."""
from detr_tf.weights.files import WeightImportError
from detr_tf.weights.importer import load_pretrained
from detr_tf.weights.import_report import ImportReport

__all__ = ["ImportReport", "WeightImportError", "load_pretrained"]
