"""Regenerates tests/fixtures/matcher/quickstart_costs.npz: the matching costs a trained
quickstart model gives on the shapes val set, the `trained` distribution of
tools/benchmark_matcher.py (detr_tf/benchmarks/matcher_costs.py).

    python tools/train.py --gin_file=gin_configs/quickstart.gin --model_dir=DIR
    python tools/make_matcher_cost_fixture.py --model_dir=DIR \
        --checkpoint=DIR/checkpoints/ckpt-3500

The committed file was made so, from a run with the quickstart's 3500 steps. Without --gin_file
the run's own DIR/config.gin is used. The model (EMA weights when the checkpoint has them) runs
in inference mode on the first --num_images val images, and its run's own criterion builds the
costs: it is called on each batch as in training, with its matcher wrapped to record what it is
given (`matcher_costs.criterion_costs`), so every output it matches is there (for the quickstart
the 2 auxiliary decoder layers and the final one; the encoder proposals are centre-assigned,
not matched).

Arrays (see matcher_costs.TrainedCosts): costs [I, L, Q, M] float32 (M = the most objects in
an image), pad_cost [I, L, Q] float32 (the cost of a padding slot, the same for all of an
image's), mask [I, M] bool, num_slots (the T the run pads targets to), metadata (str).
"""
import os
import sys
from typing import Tuple

from absl import app, flags, logging

from detr_tf import cli

cli.define_run_flags()
flags.adopt_module_key_flags(cli)  # list them in this tool's --helpshort
flags.DEFINE_integer("num_images", 200, "Val images to take (the shapes val set has 200).")
flags.DEFINE_integer("batch_size", 16, "Images per forward pass.")
flags.DEFINE_bool("use_ema", True, "Use the EMA weights when the checkpoint has them.")
flags.DEFINE_string("output", None, "Where to write (default: the committed fixture).")
FLAGS = flags.FLAGS


def collect(model, dataset, criterion, num_images: int) -> Tuple:
    """(costs [I, L, Q, T] float32, mask [I, T] bool) of the first `num_images` real images."""
    import numpy as np

    from detr_tf.benchmarks import matcher_costs
    from detr_tf.evaluation import evaluate

    costs, masks = [], []
    for element in dataset:
        images, pixel_mask, targets = evaluate.unpack_batch(element)
        outputs = model(images, pixel_mask, training=False)
        calls = matcher_costs.criterion_costs(criterion, outputs, targets)
        if len(calls) != 1 or calls[0][0].ndim != 4:
            raise ValueError(f"{type(criterion).__name__} called its matcher with costs of shapes "
                             f"{[c.shape for c, _ in calls]}; expected one call of [L, B, Q, T]")
        cost, mask = calls[0]
        real = targets["image_id"].numpy() >= 0  # [B]; the last batch is filled with fillers
        costs.append(cost.transpose(1, 0, 2, 3)[real])  # [B', L, Q, T]
        masks.append(mask[0][real])  # [B', T]
        if sum(len(m) for m in masks) >= num_images:
            break
    return np.concatenate(costs)[:num_images], np.concatenate(masks)[:num_images]


def split_padding(costs, mask) -> Tuple:
    """(costs [I, L, Q, M], pad_cost [I, L, Q], mask [I, M]) with M = the most real targets;
    checks the real targets are a prefix and every padding slot of an image costs the same."""
    import numpy as np

    counts = mask.sum(1)
    m, t = int(counts.max()), mask.shape[1]
    if not np.array_equal(mask, np.arange(t) < counts[:, None]):
        raise ValueError("the targets' mask is not a prefix of real slots in every image")
    if m == t:
        raise ValueError(f"an image fills all {t} target slots: no padding slot to record; "
                         "raise build_dataset.max_boxes")
    pad_cost = costs[..., t - 1]  # [I, L, Q]: the last slot is padding in every image
    padding = ~mask[:, None, None, :]  # [I, 1, 1, T]
    if not np.all(np.where(padding, costs == pad_cost[..., None], True)):
        raise ValueError("padding slots of one image have different costs: the criterion no "
                         "longer pads every target alike")
    return costs[..., :m], pad_cost, mask[:, :m]


def main(argv):
    logging.set_verbosity(logging.WARNING)
    cli.reject_positional("make_matcher_cost_fixture.py", argv)
    cli.parse_tool_config("make_matcher_cost_fixture.py", FLAGS.gin_file, FLAGS.gin_param,
                          FLAGS.model_dir)
    cli.run_tool("make_matcher_cost_fixture.py", write_fixture)


def write_fixture() -> None:
    import numpy as np

    from detr_tf import run as run_lib
    from detr_tf.benchmarks import matcher_costs
    from detr_tf.evaluation import restore

    model, path = restore.load_trained_model(FLAGS.model_dir, FLAGS.checkpoint, FLAGS.use_ema)
    run = run_lib.assemble()
    dataset = run.dataset_fn(is_training=False, global_batch_size=FLAGS.batch_size,
                             deterministic=True, seed=0)
    costs, mask = collect(model, dataset, run.criterion, FLAGS.num_images)
    costs, pad_cost, short_mask = split_padding(costs, mask)
    # The command with the run's directory as DIR: the fixture names no local path.
    command = " ".join(["python tools/make_matcher_cost_fixture.py"] + [
        arg.replace(FLAGS.model_dir.rstrip("/"), "DIR") for arg in sys.argv[1:]])
    metadata = (f"step {restore.checkpoint_step(path)} of a quickstart run "
                f"(gin_configs/quickstart.gin), {len(costs)} shapes val images, "
                f"{type(run.criterion).__name__} costs of {costs.shape[1]} decoder layers; "
                f"made by: {command}")
    out = FLAGS.output or matcher_costs.FIXTURE
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, costs=costs.astype(np.float32),
                        pad_cost=pad_cost.astype(np.float32), mask=short_mask,
                        num_slots=np.int32(mask.shape[1]), metadata=np.str_(metadata))
    print(f"wrote {out} ({os.path.getsize(out) / 1024:.0f} KB): costs {costs.shape}, "
          f"real targets per image {short_mask.sum(1).min()}-{short_mask.sum(1).max()} "
          f"({short_mask.all(1).sum()} images full), {metadata}")


if __name__ == "__main__":
    app.run(main)
