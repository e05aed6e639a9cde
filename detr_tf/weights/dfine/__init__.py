"""Where each tensor of a transformers D-FINE goes in a built detr_tf D-FINE, one module per
part (`hf_targets` tables under transformers 5.x key names)."""
