"""Deployment formats converted from the exported SavedModel's `serving_fixed` signature.

    tflite.py       TensorFlow's TFLite converter: float32, float16 weights, int8 (dynamic range
                    or full integer with a representative dataset)
    onnx_export.py  tf2onnx, checked for ops ONNX Runtime cannot run
    runtimes.py     one call interface over the SavedModel, LiteRT and ONNX Runtime
    accuracy.py     COCO AP of an exported form on a run's validation images
    saved_model.py  a SavedModel's signatures, read without loading it
    formats.py      tools/export.py: the run's SavedModel and the formats asked for

tf2onnx, onnxruntime and ai-edge-litert are the optional `export` extra
(`pip install -e ".[export]"`); nothing here imports them until a conversion or a run needs them.
"""
