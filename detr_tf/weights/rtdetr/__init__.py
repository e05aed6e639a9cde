"""Where each tensor of a transformers RT-DETR goes in a built detr_tf RT-DETR, one module per
part (`hf_targets` tables under transformers 5.x key names)."""
