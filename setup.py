"""detr_tf: DETR-family object detectors in TensorFlow 2, trained efficiently."""
from setuptools import find_packages, setup

# TFLite (LiteRT) and ONNX export and their runtimes (docs/EXPORT.md). The test extra includes
# them so that the export parity tests run wherever the README's test command runs, CI included.
EXPORT = ["tf2onnx>=1.17,<2", "onnx>=1.17", "onnxruntime>=1.20", "ai-edge-litert>=2.0"]

setup(
    name="detr_tf",
    version="0.1.0",
    description="Gin-configured TensorFlow 2 framework for training DETR detectors "
    "with XLA, on-device batched Hungarian matching and multi-device scaling.",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["detr_tf", "detr_tf.*"]),
    install_requires=[
        # Keras 2 (tf-keras) is the Keras that tf-models-official and Horovod build on.
        "tensorflow==2.20.*",
        "tf-keras==2.20.*",
        "tf-models-official==2.20.*",
        "gin-config==0.5.*",
        "tensorflow-datasets>=4.9.9,<4.10",
        "pycocotools>=2.0.8,<2.1",
        "numpy>=1.26,<2.5",
        "scipy>=1.13,<1.18",
        "absl-py>=1.4",
        "Pillow>=10",
        "tqdm>=4.66",
        "safetensors>=0.4",
        "pyyaml>=6",  # YOLO datasets' data.yaml (docs/FINETUNING.md)
    ],
    extras_require={
        "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "hypothesis>=6.100,<7"] + EXPORT,
        "export": EXPORT,
        # Reading torch .pth weight files, and the `pytest -m torch` comparisons.
        "torch": ["torch>=2.1", "torchvision", "timm", "transformers"],
    },
)
