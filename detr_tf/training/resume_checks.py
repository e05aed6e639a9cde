"""What a resumed run must keep from the run whose checkpoints it continues.

The images per step (`train.global_batch_size` x `train.grad_accum_steps`): a resumed run
positions its input by the steps taken (the stage schedule and the deterministic replay count
images as steps x images per step), and its epoch-based schedules convert epochs to steps with
it. Steps of another size would put the input and the learning-rate drops in the wrong place,
silently; so the size is recorded beside the checkpoints and a resume with another is refused.
"""
import json
import os
from typing import Optional

from detr_tf import atomic_files
from detr_tf.training import checkpointing

RECORD = "input.json"  # in model_dir/checkpoints


def check_images_per_step(model_dir: str, images_per_step: int) -> None:
    """Refuses to resume `model_dir` with other images per step than its checkpoints were
    trained with (before the run is built, so nothing is written).

    Raises:
      ValueError: naming both sizes, the checkpoint and the two ways on.
    """
    latest = checkpointing.latest_checkpoint(model_dir)
    recorded = _read(_path(model_dir)) if latest else None
    if recorded is not None and recorded != images_per_step:
        raise ValueError(
            f"{model_dir} was trained to step {checkpointing.checkpoint_step(latest)} at "
            f"{recorded} images per step (train.global_batch_size x train.grad_accum_steps); "
            f"this run gives {images_per_step}. A resumed run keeps the size: its input "
            "position and its epoch schedule count steps of it. Resume with the same size, or "
            f"start a new --model_dir from these weights (train.init_weights='{latest}'), "
            "whose schedule starts anew.")


def record_images_per_step(model_dir: str, images_per_step: int) -> None:
    """Records the run's images per step beside its checkpoints (on the chief, once the run
    is built)."""
    path = _path(model_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_files.write_text(path, json.dumps({"images_per_step": images_per_step}))


def _path(model_dir: str) -> str:
    return os.path.join(checkpointing.checkpoint_dir(model_dir), RECORD)


def _read(path: str) -> Optional[int]:
    """The recorded images per step; None for checkpoints written before the record was."""
    try:
        with open(path) as f:
            return int(json.load(f)["images_per_step"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} cannot be read ({e}); it records the images per step of the "
                         "run's checkpoints. Remove it to resume without the check.") from None
