"""The end of a training run, on the chief: the final evaluation, the summary line, the
after-train hook and how long the run took and where.

The training is saved before any of it, so a termination signal here does not wait: it cuts the
evaluation or the hook at once and says in one line what was cut and how to redo it, and the
run ends as one stopped by a first signal during training does (exit status 0).
"""
import time

from detr_tf import config, machine
from detr_tf.durations import format_elapsed
from detr_tf.training import checkpointing
from detr_tf.training.host_loop import ema_weights, evaluate


def finish(result, state, engine, writer, model_dir, eval_fn, after_train_fn, timing, watch):
    """The final evaluation, the summary line, the after-train hook and, last, how long the
    run took and where, after the machine it ran on: its CPU kind, and whether other processes
    took CPU time from it since `watch` started (on the chief). Returns the run's last training
    scalars and its final eval metrics (the last periodic ones when a signal cut it)."""
    doing = ["the final evaluation"]  # what a signal would cut, updated as the work goes on
    try:
        with checkpointing.cut_short_on_signal():
            eval_metrics = _final_work(result, state, engine, writer, model_dir, eval_fn,
                                       after_train_fn, timing, doing)
    except checkpointing.CutShort as signal_name:
        eval_metrics = result.eval_metrics
        if engine.is_chief:
            print(_cut_short_line(signal_name, doing[0], result.step, model_dir,
                                  eval_fn is not None), flush=True)
    else:
        if engine.is_chief:
            for note in config.unused_binding_notes():
                print(f"detr_tf: note: {note}", flush=True)
            print(f"detr_tf: machine: {machine.summary(machine.record(watch))}", flush=True)
            # The process's own start-up (imports) comes before train() and is not counted.
            print(f"detr_tf: done in {format_elapsed(sum(timing.values()))} ("
                  + ", ".join(f"{k} {format_elapsed(v)}" for k, v in timing.items()) + ")",
                  flush=True)
    writer.close()
    engine.barrier()
    return {"step": result.step, **result.last_train,
            **{f"eval/{k}": v for k, v in eval_metrics.items()}}


def _final_work(result, state, engine, writer, model_dir, eval_fn, after_train_fn, timing,
                doing):
    """The final evaluation, the summary line and the after-train hook (on the chief);
    `doing[0]` says which of them is under way. Returns the final eval metrics."""
    eval_metrics = result.eval_metrics
    if eval_fn is not None and engine.is_chief:
        t0 = time.time()
        eval_metrics = evaluate(eval_fn, state, model_dir, result.step, writer)
        timing["final evaluation"] = time.time() - t0
    if engine.is_chief:
        shown = {k: result.last_train[k] for k in ("loss", "class_error")
                 if k in result.last_train}
        shown.update({k: eval_metrics[k] for k in ("AP", "AP50") if k in eval_metrics})
        said = ", ".join(f"{k} {v:.4g}" for k, v in shown.items()) or (
            "no step to take (the run had already reached it)" if result.step else
            "no step to take (train.num_steps = 0)")
        print(f"detr_tf: finished at step {result.step}: {said}", flush=True)
    if after_train_fn is not None and engine.is_chief:
        doing[0] = "the after-train report (train.after_train_fn)"
        t0 = time.time()
        with ema_weights(state.ema):
            after_train_fn(model=state.model, model_dir=model_dir)
        timing["after-train"] = time.time() - t0
    return eval_metrics


def _cut_short_line(signal_name, what: str, step: int, model_dir: str, evaluates: bool) -> str:
    """The one line of a run whose final evaluation or after-train report a signal cut."""
    path = checkpointing.latest_checkpoint(model_dir)
    alone = (f"; or evaluate alone: python tools/eval.py --model_dir={model_dir}" if evaluates
             else "")
    return (f"detr_tf: {signal_name} received during {what}, which was cut; the training is "
            f"complete and saved ({path} at step {step}). Run the same train.py command again "
            f"to redo what was cut: it resumes at step {step} and trains no further{alone}")
