"""Benchmarks detr_tf's batched Hungarian matcher against a scipy loop and Model Garden's matcher.

    python tools/benchmark_matcher.py --json_out=/tmp/matcher.json

Costs are DETR-like: built with `match_cost` from random predictions and targets, with a random
number of real targets per problem (the rest padded). Every case times, in interleaved rounds:
ours (`tf.function(jit_compile=True)`, after warm-up), scipy.optimize.linear_sum_assignment
called once per problem, and, for square all-real cases, TF Model Garden's DETR matcher
(official/projects/detr/ops/matchers.py, also jit-compiled). It also reports the first-call
compile time, the while-loop iterations of our solve, and checks our total cost against scipy's.
"""
import json
import time
from typing import Dict, List

from absl import app, flags
from detr_tf import cli  # noqa: F401 -- first: quiets TensorFlow's C++ logs before it loads
import numpy as np
import scipy.optimize
import tensorflow as tf

from detr_tf.ops import matching

tf.get_logger().setLevel("ERROR")  # Model Garden's matcher logs deprecation warnings

FLAGS = flags.FLAGS
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds per case.")
flags.DEFINE_integer("mg_rounds", 3, "Rounds for Model Garden's matcher (it is slow).")
flags.DEFINE_string("cases", "384x100x10,384x100x20,384x100x50,384x100x100,"
                    "384x100x100full,8x100x100full",
                    "Comma-separated NxQxT; suffix 'full' = every target real (no padding).")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_integer("mg_max_n", 8, "Run Model Garden's matcher only for batches up to this size "
                     "(at [384, 100, 100] it did not finish 3 calls in 9 minutes on the 2-core "
                     "development machine).")


def detr_like_problem(rng: np.random.Generator, n: int, q: int, t: int, full: bool):
    """Returns cost [N, Q, T] float32 and target mask [N, T] bool."""
    num_classes = 92
    logits = rng.normal(size=(n, q, num_classes)).astype(np.float32) * 2
    pred_boxes = np.concatenate([rng.uniform(0.1, 0.9, (n, q, 2)),
                                 rng.uniform(0.02, 0.5, (n, q, 2))], -1).astype(np.float32)
    labels = rng.integers(0, num_classes - 1, (n, t))
    tgt_boxes = np.concatenate([rng.uniform(0.1, 0.9, (n, t, 2)),
                                rng.uniform(0.02, 0.5, (n, t, 2))], -1).astype(np.float32)
    cost = matching.match_cost(logits, pred_boxes, labels, tgt_boxes).numpy()
    if full:
        mask = np.ones((n, t), bool)
    else:
        mask = np.arange(t)[None, :] < rng.integers(t // 2, t + 1, (n, 1))
    return cost, mask


def scipy_loop(cost: np.ndarray, mask: np.ndarray) -> float:
    total = 0.0
    for b in range(cost.shape[0]):
        sub = cost[b][:, mask[b]]
        rows, cols = scipy.optimize.linear_sum_assignment(sub)
        total += float(sub[rows, cols].astype(np.float64).sum())
    return total


def our_total(cost: np.ndarray, out: np.ndarray) -> float:
    q_idx = out >= 0
    b_idx = np.nonzero(q_idx)[0]
    return float(cost[b_idx, np.nonzero(q_idx)[1], out[q_idx]].astype(np.float64).sum())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_case(spec: str, rng: np.random.Generator) -> Dict:
    full = spec.endswith("full")
    n, q, t = (int(x) for x in spec.replace("full", "").split("x"))
    cost, mask = detr_like_problem(rng, n, q, t, full)
    cost_t, mask_t = tf.constant(cost), tf.constant(mask)

    ours = tf.function(matching.hungarian_matching_with_stats, jit_compile=True)
    compile_s = timed(lambda: ours(cost_t, mask_t)[0].numpy())
    out, iterations, steps = (x.numpy() for x in ours(cost_t, mask_t))
    scipy_total = scipy_loop(cost, mask)
    ours_total = our_total(cost, out)

    mg = None
    if full and q == t and n <= FLAGS.mg_max_n:
        # Imported only here: the package is heavy and only the square cases need it.
        from official.projects.detr.ops import matchers as mg_matchers
        mg = tf.function(lambda c: mg_matchers.hungarian_matching(c)[1], jit_compile=True)
        mg_compile_s = timed(lambda: mg(cost_t).numpy())

    times: Dict[str, List[float]] = {"ours": [], "scipy": [], "model_garden": []}
    for r in range(FLAGS.rounds):
        times["ours"].append(timed(lambda: ours(cost_t, mask_t)[0].numpy()))
        times["scipy"].append(timed(lambda: scipy_loop(cost, mask)))
        if mg is not None and r < FLAGS.mg_rounds:
            times["model_garden"].append(timed(lambda: mg(cost_t).numpy()))

    result = dict(case=spec, n=n, q=q, t=t, padded=not full,
                  compile_s=compile_s, iterations=int(iterations),
                  steps_mean=float(steps.mean()), steps_max=int(steps.max()),
                  ours_total=ours_total, scipy_total=scipy_total,
                  exact=bool(abs(ours_total - scipy_total) <= 1e-5 * max(1.0, abs(scipy_total))))
    for name, values in times.items():
        if values:
            result[f"{name}_ms_min"] = 1e3 * min(values)
            result[f"{name}_ms_median"] = 1e3 * float(np.median(values))
    if mg is not None:
        result["model_garden_compile_s"] = mg_compile_s
    return result


def main(argv):
    del argv
    rng = np.random.default_rng(FLAGS.seed)
    results = []
    header = (f"{'case':>18} {'ours ms':>9} {'scipy ms':>9} {'ours/scipy':>10} {'MG ms':>9} "
              f"{'MG/ours':>8} {'iters':>6} {'steps mean':>10} {'compile s':>9} exact")
    print(header)
    for spec in FLAGS.cases.split(","):
        r = run_case(spec.strip(), rng)
        results.append(r)
        mg = r.get("model_garden_ms_min")
        mg_text = f"{mg:9.1f} {mg / r['ours_ms_min']:8.0f}" if mg else f"{'-':>9} {'-':>8}"
        print(f"{r['case']:>18} {r['ours_ms_min']:9.2f} {r['scipy_ms_min']:9.2f} "
              f"{r['ours_ms_min'] / r['scipy_ms_min']:10.2f} {mg_text} "
              f"{r['iterations']:6d} {r['steps_mean']:10.1f} {r['compile_s']:9.1f} {r['exact']}",
              flush=True)
    print("times are minimums over interleaved rounds; medians are in the JSON.")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(results=results, rounds=FLAGS.rounds,
                           devices=[d.name for d in tf.config.list_logical_devices()]), f,
                      indent=2)


if __name__ == "__main__":
    app.run(main)
