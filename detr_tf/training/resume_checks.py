"""What a resumed run must keep from the run whose checkpoints it continues.

The images per step (`train.global_batch_size` x `train.grad_accum_steps`): a resumed run
positions its input by the steps taken (the stage schedule and the deterministic replay count
images as steps x images per step), and its epoch-based schedules convert epochs to steps with
it. Steps of another size would put the input and the learning-rate drops in the wrong place,
silently; so the size is recorded beside the checkpoints and a resume with another is refused.

The precision (`train.precision`, resolved) is recorded too, but a resume may change it: the
weights, optimizer slots and EMA are float32 in every precision. A run resumed on another kind
of machine says what changed in one line (`precision_change`).
"""
import json
import os
from typing import Any, Dict

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
    recorded = _read(_path(model_dir)).get("images_per_step") if latest else None
    if recorded is not None and recorded != images_per_step:
        raise ValueError(
            f"{model_dir} was trained to step {checkpointing.checkpoint_step(latest)} at "
            f"{recorded} images per step (train.global_batch_size x train.grad_accum_steps); "
            f"this run gives {images_per_step}. A resumed run keeps the size: its input "
            "position and its epoch schedule count steps of it. Resume with the same size, or "
            f"start a new --model_dir from these weights (train.init_weights='{latest}'), "
            "whose schedule starts anew.")


def precision_change(model_dir: str, precision: str, loss_scale=None) -> str:
    """The line a resumed run prints when its checkpoints were trained under another
    `train.precision` than `precision` (resolved), saying what of the state carries over; ''
    when it is the same or was not recorded (checkpoints from before the record held it).

    Args:
      loss_scale: this run's loss scale (optimization.DynamicLossScale, mixed_float16 only).
    """
    trained = _read(_path(model_dir)).get("precision")
    if trained is None or trained == precision:
        return ""
    said = (f"train.precision is {precision} here, {trained} where the checkpoints were "
            "trained: the weights, optimizer slots and EMA are float32 in both and resume as "
            "saved")
    if loss_scale is not None:
        said += f"; the loss scale starts anew at {float(loss_scale.scale.numpy()):g}"
    elif trained == "mixed_float16":
        said += "; the saved loss scale is left unused (only mixed_float16 scales the loss)"
    return said


def record_run(model_dir: str, images_per_step: int, precision: str) -> None:
    """Records the run's images per step and precision beside its checkpoints (on the chief,
    once the run is built)."""
    path = _path(model_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_files.write_text(path, json.dumps({"images_per_step": images_per_step,
                                              "precision": precision}))


def _path(model_dir: str) -> str:
    return os.path.join(checkpointing.checkpoint_dir(model_dir), RECORD)


def _read(path: str) -> Dict[str, Any]:
    """The record: images_per_step (an int) and, since it was recorded, precision; empty for
    checkpoints written before the record was."""
    try:
        with open(path) as f:
            record = json.load(f)
        record["images_per_step"] = int(record["images_per_step"])
        return record
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} cannot be read ({e}); it records the images per step of the "
                         "run's checkpoints. Remove it to resume without the check.") from None
