"""The host side of the training loop: run device loops of steps, and between them apply the NaN
policy, log, save, evaluate and honour termination signals.

Everything that needs the host happens here, between device loops (detr_tf/training/
device_loop.py: up to `train.steps_per_loop` steps per host visit); the step itself
(detr_tf/training/step.py) never leaves the device. A loop is cut short so that it ends exactly
on every log, checkpoint and evaluation step and on the last step, so these happen at the steps
configured whatever steps_per_loop is. The first step runs alone: it traces and compiles, and
its end writes the operative config and starts the progress line's clock, as early as with
one step per loop.
"""
import dataclasses
import math
import time
from typing import Callable, Dict, Optional

from detr_tf.durations import counted
from detr_tf.training import checkpointing, optimization
from detr_tf.training.device_loop import DeviceLoop, LoopOutcome
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
    steps_per_loop: int = 1
    nan_skip_limit: int = 0

    def loop_length(self, step: int, evaluates: bool) -> int:
        """Steps the next device loop runs from `step`: at most steps_per_loop, ending on the
        next log, checkpoint or evaluation step or on the last step.

        It depends only on the step and the configuration, so every process of a run cuts its
        loops alike (saves and the stop-flag check are collectives)."""
        n = min(self.steps_per_loop, self.num_steps - step)
        for every in (self.log_every, self.checkpoint_every,
                      self.eval_every if evaluates else None):
            if every and every > 0:
                n = min(n, every - step % every)
        return n


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


# The step's booleans, reported but not logged as numbers.
_FLAGS = ("applied", "loss_finite", "finite")


def _terms_by_finiteness(stats: Dict[str, float]) -> str:
    """'not finite: a=nan, b=inf; finite: c=1.5': the step's logged terms, the ones that went
    non-finite first (of a model's dozens of loss terms, often one or two)."""
    terms = sorted((k, v) for k, v in stats.items() if k not in _FLAGS)
    said = lambda items: ", ".join(f"{k}={v:.4g}" for k, v in items)  # noqa: E731
    bad = [(k, v) for k, v in terms if not math.isfinite(v)]
    good = [(k, v) for k, v in terms if math.isfinite(v)]
    return (f"not finite: {said(bad) or 'none of the logged values'}"
            + (f"; finite: {said(good)}" if good else ""))


@dataclasses.dataclass
class _Skips:
    """Steps skipped under nan_policy='skip': in all, and in the current run of them (counted
    in whole device loops: a loop with a finite step ends a run)."""
    total: int = 0
    in_a_row: int = 0
    since: int = 0  # the first step of the current run


def _apply_nan_policy(outcome: LoopOutcome, first_step: int, cfg: LoopConfig,
                      saver: checkpointing.CheckpointSaver, writer: MetricsWriter,
                      skips: _Skips) -> None:
    """Raises (nan_policy='stop', or 'skip' past cfg.nan_skip_limit steps in a row) or reports
    skipped steps, counting them in `skips`.

    first_step is the global step of the loop's first step; with 'stop' the loop ended at the
    first non-finite step, so the last values are that step's.
    """
    if not outcome.non_finite:
        skips.in_a_row = 0
        return
    bad = first_step + outcome.first_non_finite
    last = first_step + outcome.steps - 1  # with 'stop': the bad step, where the loop ended
    span = (f" (the first non-finite of steps {first_step}-{last}, run in one device loop; "
            f"train.steps_per_loop={cfg.steps_per_loop})" if outcome.steps > 1 else "")
    if cfg.nan_policy == "stop":
        what = ("non-finite gradients (the loss is finite)" if outcome.stats.get("loss_finite")
                else "non-finite loss")
        writer.close()
        raise TrainingError(
            f"{what} at step {bad}{span}: {_terms_by_finiteness(outcome.stats)}"
            + f". The weights were not updated by this step; the last checkpoint "
            f"({saver.latest or 'none yet'}) is untouched. Set "
            "train.nan_policy='skip' to skip such steps instead.")
    skips.total += outcome.non_finite
    if outcome.non_finite < outcome.steps:
        skips.in_a_row = 0
    else:
        skips.since = skips.since if skips.in_a_row else bad
        skips.in_a_row += outcome.steps
    if outcome.steps == 1:
        print(f"detr_tf: step {bad}: non-finite loss or gradients, step skipped ({skips.total} "
              "so far)", flush=True)
    else:
        print(f"detr_tf: steps {first_step}-{last}: {outcome.non_finite} with a non-finite "
              f"loss or gradients, skipped (the first at step {bad}; {skips.total} so far)",
              flush=True)
    if cfg.nan_skip_limit and skips.in_a_row >= cfg.nan_skip_limit:
        writer.close()
        raise TrainingError(
            f"{counted(skips.in_a_row, 'step')} in a row skipped (steps {skips.since}-{last}), "
            "each with a non-finite loss or gradients: the weights have not changed since step "
            f"{skips.since - 1}, and an update before it may have left them unusable. The last "
            f"checkpoint is {saver.latest or 'none yet'}; an earlier one of "
            "model_dir/checkpoints may predate the fault. Lower the learning rate, or raise "
            "train.nan_skip_limit (0: no limit).")


def _scalars(stats: Dict[str, float], state: TrainState, images_per_sec: float,
             step_time: float) -> Dict[str, float]:
    scalars = {k: float(v) for k, v in stats.items() if k not in _FLAGS}
    # The rates the last step used: the schedule at its step (global_step already counts it).
    last = state.global_step.read_value() - 1
    scalars["learning_rate"] = float(optimization.schedule_of(state.optimizers[1]).at(last))
    scalars["backbone_learning_rate"] = float(
        optimization.schedule_of(state.optimizers[0]).at(last))
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


class _Throughput:
    """images/s since the last log, and the progress line."""

    def __init__(self, cfg: LoopConfig, engine):
        self.cfg = cfg
        self.progress = Progress(cfg.num_steps, enabled=engine.is_chief)
        self.window_t, self.window_steps = time.time(), 0
        self.cut_noted = not engine.is_chief  # one note per run, from the chief

    def note_cut_targets(self, step: int, outcome: LoopOutcome) -> None:
        """Says once when a step's targets lost boxes to build_dataset.max_boxes."""
        cut = int(outcome.stats.get("targets_cut", 0))
        if cut and not self.cut_noted:
            self.cut_noted = True
            self.progress.end_line()
            print(f"detr_tf: step {step}: {cut} target boxes beyond build_dataset.max_boxes were "
                  "cut from the batches; their objects stay in the images and are trained as "
                  "background. Raise build_dataset.max_boxes (a mosaic holds the boxes of four "
                  "images); metrics.jsonl's targets_cut counts them in each logged row's last "
                  "host visit (train.steps_per_loop steps).",
                  flush=True)

    def log(self, step: int, steps: int, elapsed: float, outcome: LoopOutcome,
            state: TrainState, writer: MetricsWriter, result: LoopResult) -> None:
        cfg = self.cfg
        self.window_steps += steps
        if step % cfg.log_every == 0 or step == cfg.num_steps:
            now = time.time()
            ips = cfg.images_per_step * self.window_steps / max(now - self.window_t, 1e-9)
            self.window_t, self.window_steps = now, 0
            result.last_train = _scalars(outcome.stats, state, ips, elapsed / steps)
            writer.write(step, result.last_train)
            self.progress.update(step, ips, result.last_train.get("loss"),
                                 force=step == cfg.num_steps)
        else:
            self.progress.update(step, cfg.images_per_step * steps / max(elapsed, 1e-9))


def run_loop(device_loop: DeviceLoop, iterator, state: TrainState, engine,
             saver: checkpointing.CheckpointSaver, writer: MetricsWriter, cfg: LoopConfig,
             model_dir: str, eval_fn: Optional[Callable[..., Dict[str, float]]] = None,
             on_first_step: Optional[Callable[[], None]] = None) -> LoopResult:
    """Trains from the current global step to cfg.num_steps, or until a termination signal.

    Checkpoints are written every cfg.checkpoint_every steps, at the last step and when a
    termination signal reaches any process (all processes then stop after the same step); the
    caller writes none. Every process makes the same saving decisions: a save is a collective
    under MultiWorkerMirroredStrategy.
    """
    step = start = int(state.global_step.numpy())
    result, skips = LoopResult(step, {}, {}), _Skips()
    throughput = _Throughput(cfg, engine)
    evaluates = eval_fn is not None and bool(cfg.eval_every)
    progress = throughput.progress
    with checkpointing.TerminationSignal() as term:
        try:
            while step < cfg.num_steps:
                t0 = time.time()
                # The first step runs alone: it traces and compiles (see the module docstring).
                n = 1 if step == start else cfg.loop_length(step, evaluates)
                outcome = device_loop(iterator, n)
                first, step = step + 1, step + outcome.steps
                result.step = step
                if on_first_step is not None:
                    on_first_step()
                    on_first_step = None
                if outcome.non_finite:
                    progress.end_line()
                _apply_nan_policy(outcome, first, cfg, saver, writer, skips)
                throughput.log(step, outcome.steps, time.time() - t0, outcome, state, writer,
                               result)
                throughput.note_cut_targets(step, outcome)
                if (step % cfg.checkpoint_every == 0 or step == cfg.num_steps) and (
                        saver.saved_step != step):
                    with term.holding():
                        saver.save(step)
                if (evaluates and engine.is_chief and step % cfg.eval_every == 0
                        and step != cfg.num_steps):
                    progress.end_line()
                    result.eval_metrics = evaluate(eval_fn, state, model_dir, step, writer)
                # Every process asks the others at every loop boundary, so a signal to any one
                # of them stops all at the same step, and all take part in the same last save.
                if engine.any_process(term.received):
                    with term.holding():
                        path = (saver.save(step) if saver.saved_step != step
                                else saver.checkpoint_path(step))
                    progress.end_line()
                    _report_stop(engine, term.received, step, path)
                    result.terminated = True
                    return result
            if saver.saved_step != step:
                with term.holding():
                    saver.save(step)
        finally:  # an error or a signal: what is printed next starts a line of its own
            progress.end_line()
    return result
