"""Keeps the weights of the best evaluation so far, apart from the rolling checkpoints.

On a small dataset the last step is rarely the best one: validation AP peaks and then falls as
the model starts to memorize the train images. The rolling checkpoints (the last few) lose that
peak; `BestCheckpoint` keeps it in `model_dir/best/`:

    model_dir/best/ckpt.index, ckpt.data-*   the model's weights (as evaluated: EMA weights
                                             when the run keeps an EMA)
    model_dir/best/best.json                 {"step", "metric", "value", "metrics"}

Evaluate or predict with them through the usual tools: `--checkpoint=best` (a bare name is the
run's: MODEL_DIR/best/ckpt).
The best value so far is read back from best.json on every call, so a resumed run keeps
comparing against the best of the whole run. A new best is written into a private directory and
swapped in by renames, so an interruption never leaves a half-written best/.
"""
import json
import os
import shutil
from typing import Dict, Optional

import gin
import tensorflow as tf

BEST_SUBDIR = "best"
BEST_JSON = "best.json"
CHECKPOINT_NAME = "ckpt"


def best_checkpoint_path(model_dir: str) -> str:
    """The prefix to pass as --checkpoint to the eval/predict/export tools."""
    return os.path.join(model_dir, BEST_SUBDIR, CHECKPOINT_NAME)


def read_best(model_dir: str) -> Optional[dict]:
    """best.json's content, or None when nothing was kept yet."""
    path = os.path.join(model_dir, BEST_SUBDIR, BEST_JSON)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


@gin.configurable
class BestCheckpoint:
    """A callable (model, model_dir, step, metrics) -> bool that saves the model's weights to
    model_dir/best/ when `metrics[metric]` beats the best kept so far.

    Args:
      metric: the key of the metrics dict to compare (COCO 'AP' by default).
      higher_is_better: False for a metric to minimize (a loss).
    """

    def __init__(self, metric: str = "AP", higher_is_better: bool = True):
        self.metric = metric
        self.higher_is_better = higher_is_better

    def _improves(self, value: float, best: Optional[dict]) -> bool:
        if best is None:
            return True
        return value > best["value"] if self.higher_is_better else value < best["value"]

    def __call__(self, model: tf.Module, model_dir: str, step: int,
                 metrics: Dict[str, float]) -> bool:
        """Saves when the metric improves; returns whether it did.

        Raises:
          KeyError: `metrics` lacks the metric (the message lists the keys it has).
        """
        if self.metric not in metrics:
            raise KeyError(f"BestCheckpoint.metric={self.metric!r} is not among the evaluation "
                           f"metrics {sorted(metrics)}.")
        value = float(metrics[self.metric])
        best = read_best(model_dir)
        if not self._improves(value, best):
            return False
        final = os.path.join(model_dir, BEST_SUBDIR)
        work = f"{final}.partial-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        ckpt = tf.train.Checkpoint(model=model)
        # Created before the write so the file matches the trainer's checkpoints, which the
        # tools' restore (assert_existing_objects_matched) expects.
        ckpt.save_counter.assign_add(1)
        ckpt.write(os.path.join(work, CHECKPOINT_NAME))
        record = {"step": int(step), "metric": self.metric, "value": value,
                  "metrics": {k: float(v) for k, v in metrics.items()}}
        with open(os.path.join(work, BEST_JSON), "w") as f:
            json.dump(record, f, indent=1)
        old = f"{final}.old-{os.getpid()}"
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(work, final)
        shutil.rmtree(old, ignore_errors=True)
        previous = f" (was {best['value']:.4g} at step {best['step']})" if best else ""
        print(f"best: {self.metric} {value:.4g} at step {step}{previous}; weights in "
              f"{best_checkpoint_path(model_dir)}", flush=True)
        return True
