"""The training loop: run steps, and between them apply the NaN policy, log, save, evaluate and
honour termination signals.

Everything that needs the host happens here, between compiled steps; the step itself
(detr_tf/training/step.py) never leaves the device.
"""
import dataclasses
import time
from typing import Any, Callable, Dict, Optional

from detr_tf.training import checkpointing
from detr_tf.training import distribution as dist
from detr_tf.training.metrics_writer import MetricsWriter, Progress
from detr_tf.training.state import TrainState


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what was kept."""


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    num_steps: int
    images_per_step: int
    log_every: int
    checkpoint_every: int
    eval_every: Optional[int]
    nan_policy: str


@dataclasses.dataclass
class LoopResult:
    step: int
    last_train: Dict[str, float]
    eval_metrics: Dict[str, float]
    terminated: bool = False


class ema_weights:
    """Context: the model holds its EMA weights inside, its own weights after."""

    def __init__(self, ema):
        self.ema = ema

    def __enter__(self):
        if self.ema is not None:
            self.ema.swap()

    def __exit__(self, *exc):
        if self.ema is not None:
            self.ema.swap()
        return False


def evaluate(eval_fn: Callable[..., Dict[str, float]], state: TrainState, model_dir: str,
             step: int, writer: MetricsWriter) -> Dict[str, float]:
    """Runs eval_fn on the EMA weights when there are any, and logs its metrics."""
    with ema_weights(state.ema):
        metrics = eval_fn(model=state.model, model_dir=model_dir, step=step)
    writer.write(step, metrics, split="eval")
    return metrics


def _check_finite(stats: Dict[str, Any], step: int, cfg: LoopConfig,
                  saver: checkpointing.CheckpointSaver, writer: MetricsWriter) -> bool:
    """Applies the NaN policy; returns True when the step was skipped."""
    if bool(stats.pop("loss_finite")):
        return False
    if cfg.nan_policy == "stop":
        terms = {k: float(v) for k, v in stats.items() if k != "applied"}
        writer.close()
        raise TrainingError(
            f"non-finite loss at step {step}: "
            + ", ".join(f"{k}={v:.4g}" for k, v in sorted(terms.items()))
            + f". The weights were not updated by this step; the last checkpoint "
            f"({saver.latest or 'none yet'}) is untouched. Set "
            "train.nan_policy='skip' to skip such steps instead.")
    return True


def _scalars(stats: Dict[str, Any], state: TrainState, images_per_sec: float,
             step_time: float) -> Dict[str, float]:
    scalars = {k: float(v) for k, v in stats.items()}
    scalars["learning_rate"] = float(state.optimizers[1].learning_rate.numpy())
    scalars["backbone_learning_rate"] = float(state.optimizers[0].learning_rate.numpy())
    scalars["images_per_sec"] = images_per_sec
    scalars["step_time_s"] = step_time
    if state.loss_scale is not None:
        scalars["loss_scale"] = float(state.loss_scale.scale.numpy())
    return scalars


def _report_stop(engine, signalled_here: bool, step: int, path: str) -> None:
    if engine.is_chief:
        print(f"detr_tf: termination signal received; saved {path} at step {step}", flush=True)
    else:
        where = "here" if signalled_here else "on another worker"
        print(f"detr_tf: worker {engine.rank}: termination signal received ({where}); "
              f"stopped at step {step} with the chief's checkpoint", flush=True)


def run_loop(step_fn: Callable, iterator, state: TrainState, engine,
             saver: checkpointing.CheckpointSaver, writer: MetricsWriter, cfg: LoopConfig,
             model_dir: str, eval_fn: Optional[Callable[..., Dict[str, float]]] = None,
             on_first_step: Optional[Callable[[], None]] = None) -> LoopResult:
    """Trains from the current global step to cfg.num_steps, or until a termination signal.

    Checkpoints are written every cfg.checkpoint_every steps, at the last step and when a
    termination signal reaches any process (all processes then stop after the same step); the
    caller writes none. Every process makes the same saving decisions: a save is a collective
    under MultiWorkerMirroredStrategy.
    """
    step = int(state.global_step.numpy())
    result = LoopResult(step, {}, {})
    progress = Progress(cfg.num_steps, enabled=engine.is_chief)
    skipped, window_t, window_steps = 0, time.time(), 0

    def save():
        return saver.save(int(state.global_step.numpy()))

    with checkpointing.TerminationSignal() as term:
        while step < cfg.num_steps:
            t0 = time.time()
            stats = step_fn(iterator)
            stats = {k: dist.maybe_value(engine, v) for k, v in stats.items()}
            step = result.step = int(state.global_step.numpy())
            if on_first_step is not None:
                on_first_step()
                on_first_step = None
            if _check_finite(stats, step, cfg, saver, writer):
                skipped += 1
                print(f"detr_tf: step {step}: non-finite loss, step skipped ({skipped} so far)",
                      flush=True)
            stats.pop("applied")
            window_steps += 1
            step_time = time.time() - t0
            if step % cfg.log_every == 0 or step == cfg.num_steps:
                now = time.time()
                ips = cfg.images_per_step * window_steps / max(now - window_t, 1e-9)
                window_t, window_steps = now, 0
                result.last_train = _scalars(stats, state, ips, step_time)
                writer.write(step, result.last_train)
                progress.update(step, ips, result.last_train.get("loss"),
                                force=step == cfg.num_steps)
            else:
                progress.update(step, cfg.images_per_step / max(step_time, 1e-9))
            if (step % cfg.checkpoint_every == 0 or step == cfg.num_steps) and (
                    saver.saved_step != step):
                save()
            if (eval_fn is not None and engine.is_chief and cfg.eval_every
                    and step % cfg.eval_every == 0 and step != cfg.num_steps):
                result.eval_metrics = evaluate(eval_fn, state, model_dir, step, writer)
            # Every process asks the others at every step boundary, so a signal to any one of
            # them stops all at the same step, and all take part in the same last save.
            if engine.any_process(term.received):
                path = save() if saver.saved_step != step else saver.checkpoint_path(step)
                _report_stop(engine, term.received, step, path)
                result.terminated = True
                return result
        if saver.saved_step != step:
            save()
    return result
