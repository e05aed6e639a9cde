"""Where each tensor of a transformers RT-DETR goes in detr_tf's RT-DETR, one module per part."""
