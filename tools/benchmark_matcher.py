"""Benchmarks detr_tf's batched matchers against a scipy loop (and Model Garden's matcher).

    python tools/benchmark_matcher.py --json_out=/tmp/matcher.json
    python tools/benchmark_matcher.py --cases=24x20x16,24x20x6full --distributions=trained

Every case NxQxT runs once per cost distribution of --distributions
(detr_tf/benchmarks/matcher_costs.py): `uniform` (i.i.d. noise, like costs early in training),
`ties` (i.i.d. integers 0-9: many exact ties), `detr` (`match_cost` of random predictions and
targets) and `trained` (a trained quickstart model's costs on the shapes val set, committed as
tests/fixtures/matcher/quickstart_costs.npz; only its own Q = 20 and T >= 6, T = 6 when full, so
it skips the other cases with a note). A random number of targets per problem is real (the rest
padded) unless the case ends in 'full'; each distribution draws from its own generator seeded
with --seed, so `--distributions=detr` gives the same costs as the benchmark gave before it had
distributions. Every case times, in interleaved rounds (one call of each in turn, in a new
random order every round, so a busy machine slows all alike):
- ours: `hungarian_matching` with the JV start (`--arr_passes`, `--unroll`), jit-compiled;
- greedy: the same exact solver with the plain greedy start and one step per loop iteration
  (the solver before the JV start), for comparison;
- sinkhorn: the approximate `sinkhorn_matching` (`--sinkhorn_epsilon`, `--sinkhorn_iters`);
- scipy: scipy.optimize.linear_sum_assignment called once per problem;
- for square all-real cases with N <= --mg_max_n, TF Model Garden's matcher;
- floor (only if asked for): a compiled program that does no matching, its output shaped like a
  matcher's. One call of it costs what any single call of a compiled program costs here (the
  dispatch from Python, and after a pause such as the scipy loop, waking the threads its work
  is split across), which every compiled matcher here pays as well
  (docs/PERFORMANCE.md#matcher).
It reports minimum and median times, the median of the per-round ratios to scipy, first-call
compile times (a case's first distribution only: the others reuse its compiled matchers), the
while-loop iterations of the exact solves (JV passes + search iterations) and their search
steps, checks the exact totals against scipy's optimum, and gives the Sinkhorn matcher's excess
cost over the optimum, relative to max(|optimum|, 1).
"""
import os
import time
from typing import Callable, Dict, List, Tuple

from absl import app, flags
from detr_tf import cli  # noqa: F401 -- first: quiets TensorFlow's C++ logs before it loads
import numpy as np
import tensorflow as tf

from detr_tf.benchmarks import matcher_costs, timing
from detr_tf.ops import matching, sinkhorn

tf.get_logger().setLevel("ERROR")  # Model Garden's matcher logs deprecation warnings

FLAGS = flags.FLAGS
cli.define_json_out_flag("Write the results as JSON here.")
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help
flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds per case.", lower_bound=1)
flags.DEFINE_integer("mg_rounds", 3, "Rounds for Model Garden's matcher (it is slow).",
                     lower_bound=1)
flags.DEFINE_string("cases", "384x100x10,384x100x20,384x100x50,384x100x100,"
                    "384x100x100full,8x100x100full,24x20x16",
                    "Comma-separated NxQxT; suffix 'full' = every target real (no padding). "
                    "24x20x16 is one quickstart training step's call (3 decoder layers x 8 "
                    "images, 20 queries, targets padded to 16).")
flags.DEFINE_list("distributions", list(matcher_costs.DISTRIBUTIONS),
                  "Cost distributions to run every case on (detr_tf/benchmarks/"
                  "matcher_costs.py).")
flags.DEFINE_string("trained_fixture", matcher_costs.FIXTURE,
                    "The 'trained' distribution's costs (tools/make_matcher_cost_fixture.py).")
VARIANTS = ("ours", "greedy", "sinkhorn", "scipy", "floor")
flags.DEFINE_list("variants", ["ours", "greedy", "sinkhorn", "scipy"],
                  f"Which of {','.join(VARIANTS)} to time; scipy is always timed (the ratios' "
                  "reference). Model Garden's matcher is added by --mg_max_n.")
flags.DEFINE_integer("arr_passes", matching.DEFAULT_ARR_PASSES,
                     "JV augmenting-row-reduction passes of 'ours'; -1 = greedy start.",
                     lower_bound=-1)
flags.DEFINE_integer("unroll", 0, "Search steps per loop iteration of 'ours'; 0 = the default "
                     "(matching.DEFAULT_CPU_UNROLL on a CPU, DEFAULT_UNROLL with a GPU or TPU).",
                     lower_bound=0)
flags.DEFINE_integer("intra_op_threads", 0,
                     "Threads of TensorFlow's intra-op pool, which XLA:CPU splits the compiled "
                     "matchers' passes over; 0 = TensorFlow's default (one per core). 1 shows "
                     "what the second core gains or costs on this machine.", lower_bound=0)
flags.DEFINE_float("sinkhorn_epsilon", 0.02, "Entropic regularisation of 'sinkhorn'.")
flags.DEFINE_integer("sinkhorn_iters", 50, "Sinkhorn iterations of 'sinkhorn'.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_integer("mg_max_n", 8, "Run Model Garden's matcher only for batches up to this size "
                     "(at [384, 100, 100] it did not finish 3 calls in 9 minutes on the 2-core "
                     "development machine); 0 = never.", lower_bound=0)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _call_floor(cost: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """[N, Q] int32 of -1, read from one element of each input: no matching at all."""
    touch = tf.cast(cost[0, 0, 0] > 0, tf.int32) * tf.cast(mask[0, 0], tf.int32)  # 0 or 1
    return tf.fill(tf.shape(cost)[:2], -1) - tf.minimum(touch, 0)


def _matchers(n: int, q: int, t: int, full: bool) -> Dict[str, Callable]:
    """name -> jit-compiled fn(cost, mask) -> (matching, stats dict), for this case."""
    passes = None if FLAGS.arr_passes < 0 else FLAGS.arr_passes
    unroll = FLAGS.unroll or None
    out = {
        "ours": lambda c, m: matching.hungarian_matching_with_stats(c, m, passes, unroll),
        "greedy": lambda c, m: matching.hungarian_matching_with_stats(c, m, None, 1),
        "sinkhorn": lambda c, m: (sinkhorn.sinkhorn_matching(
            c, m, FLAGS.sinkhorn_epsilon, FLAGS.sinkhorn_iters), {}),
        "floor": lambda c, m: (_call_floor(c, m), {}),
    }
    out = {k: tf.function(f, jit_compile=True) for k, f in out.items() if k in FLAGS.variants}
    if full and q == t and n <= FLAGS.mg_max_n:
        try:  # imported only here: the package is heavy and only the square cases need it
            from official.projects.detr.ops import matchers as mg_matchers
        except ImportError:
            print("tf-models-official is not installed: Model Garden's matcher is skipped.")
            return out
        out["model_garden"] = tf.function(lambda c, m: (mg_matchers.hungarian_matching(c)[1], {}),
                                          jit_compile=True)
    return out


_COMPILED: Dict[Tuple[int, int, int, bool], Dict[str, Callable]] = {}


def _summary(name: str, values: List[float], scipy_values: List[float]) -> Dict:
    ratios = [a / b for a, b in zip(values, scipy_values)]
    return {f"{name}_ms_min": 1e3 * min(values),
            f"{name}_ms_median": 1e3 * float(np.median(values)),
            f"{name}_ratio_median": float(np.median(ratios)) if ratios else None,
            f"{name}_rounds": len(values)}


def parse_case(spec: str) -> Tuple[int, int, int, bool]:
    """'384x100x100full' -> (384, 100, 100, True)."""
    full = spec.endswith("full")
    n, q, t = (int(x) for x in spec.replace("full", "").split("x"))
    return n, q, t, full


def run_case(spec: str, distribution: str, cost: np.ndarray, mask: np.ndarray) -> Dict:
    """Times every matcher on one problem batch: cost [N, Q, T] float32, mask [N, T] bool."""
    n, q, t, full = parse_case(spec)
    cost_t, mask_t = tf.constant(cost), tf.constant(mask)
    best = matcher_costs.optimal_totals(cost, mask)
    result = dict(case=spec, distribution=distribution, n=n, q=q, t=t, padded=not full,
                  scipy_total=float(best.sum()))
    # The distributions of a case share its compiled matchers: only the first one compiles.
    fresh = (n, q, t, full) not in _COMPILED
    if fresh:
        _COMPILED[(n, q, t, full)] = _matchers(n, q, t, full)
    fns = _COMPILED[(n, q, t, full)]
    for name, fn in fns.items():
        first = timed(lambda: fn(cost_t, mask_t)[0].numpy())
        if fresh:
            result[f"{name}_compile_s"] = first
        if name in ("model_garden", "floor"):
            continue  # timed only: no matching to check
        out, stats = fn(cost_t, mask_t)
        got = matcher_costs.matched_totals(cost, out.numpy())
        # Relative to |optimum|, but at least 1: the optimum of a full square 'ties' problem
        # is usually 0 (every row holds zeros), and then the excess is in the costs' own units.
        excess = (got - best) / np.maximum(np.abs(best), 1.0)
        result[f"{name}_exact"] = bool(np.all(np.abs(got - best)
                                              <= 1e-5 * np.maximum(1, np.abs(best))))
        result[f"{name}_excess_mean"] = float(excess.mean())
        result[f"{name}_optimal_fraction"] = float(np.mean(np.abs(got - best) <= 1e-4))
        for key, value in stats.items():
            value = value.numpy()
            result[f"{name}_{key}"] = (int(value) if value.ndim == 0
                                       else dict(mean=float(value.mean()), max=int(value.max())))
    calls = {name: (lambda fn=fn: fn(cost_t, mask_t)[0].numpy()) for name, fn in fns.items()}
    calls["scipy"] = lambda: matcher_costs.optimal_totals(cost, mask)
    times: Dict[str, List[float]] = {name: [] for name in calls}
    shuffle = np.random.default_rng(FLAGS.seed)
    for _ in range(FLAGS.rounds):
        # A new random order every round: on a loaded machine a TF call right after the scipy
        # loop waits for its idle threads to be scheduled again (the same program measured 2.5
        # vs 15 ms at [384, 100, 10] by its place in a fixed order), so no matcher may always
        # follow the same one.
        for name in shuffle.permutation(list(calls)):
            if name != "model_garden" or len(times[name]) < FLAGS.mg_rounds:
                times[name].append(timed(calls[name]))
    for name, values in times.items():
        result.update(_summary(name, values, times["scipy"][:len(values)]))
    result["order_shuffled"] = True
    return result


def _print_row(r: Dict) -> None:
    def cell(name, fmt="{:8.1f}"):
        return fmt.format(r[f"{name}_ms_median"]) if f"{name}_ms_median" in r else f"{'-':>8}"

    def ratio(name):
        return (f"{r[f'{name}_ratio_median']:6.2f}" if r.get(f"{name}_ratio_median") is not None
                else f"{'-':>6}")

    def iters(name):
        return f"{r[f'{name}_iterations']:6d}" if f"{name}_iterations" in r else f"{'-':>6}"

    excess = r.get("sinkhorn_excess_mean")
    compile_s = r.get("ours_compile_s")
    print(f"{r['case']:>16} {r['distribution']:>8} {cell('scipy')} {cell('ours')} "
          f"{ratio('ours')} {iters('ours')} {'-' if compile_s is None else f'{compile_s:.1f}':>6} "
          f"{cell('greedy')} {ratio('greedy')} "
          f"{iters('greedy')} {cell('sinkhorn')} {ratio('sinkhorn')} "
          f"{'-' if excess is None else f'{100 * excess:.2f}%':>8} "
          f"{cell('model_garden')} {cell('floor')} {r.get('ours_exact', '-')!s:>5}", flush=True)


def main(argv):
    del argv
    if FLAGS.intra_op_threads:  # before TensorFlow runs anything, or it is fixed already
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.intra_op_threads)
    unknown = sorted(set(FLAGS.variants) - set(VARIANTS))
    if unknown:
        raise app.UsageError(f"--variants: unknown {unknown}; expected some of "
                             f"{','.join(VARIANTS)}")
    unknown = sorted(set(FLAGS.distributions) - set(matcher_costs.DISTRIBUTIONS))
    if unknown:
        raise app.UsageError(f"--distributions: unknown {unknown}; expected some of "
                             f"{','.join(matcher_costs.DISTRIBUTIONS)}")
    # One generator per distribution: adding or dropping one leaves the others' costs the same.
    rngs = {name: np.random.default_rng(FLAGS.seed) for name in FLAGS.distributions}
    results, skipped = [], {}
    print(f"{'case':>16} {'costs':>8} {'scipy':>8} {'ours':>8} {'/scipy':>6} {'iters':>6} "
          f"{'cmp s':>6} {'greedy':>8} {'/scipy':>6} {'iters':>6} {'sinkhorn':>8} {'/scipy':>6} "
          f"{'excess':>8} {'MG':>8} {'floor':>8} exact")
    for spec in (s.strip() for s in FLAGS.cases.split(",")):
        n, q, t, full = parse_case(spec)
        for name in FLAGS.distributions:
            try:
                cost, mask = matcher_costs.problem(name, rngs[name], n, q, t, full,
                                                   FLAGS.trained_fixture)
            except matcher_costs.ShapeMismatch as e:
                skipped.setdefault(name, ([], str(e)))[0].append(spec)
                continue
            results.append(run_case(spec, name, cost, mask))
            _print_row(results[-1])
    print("times are medians (ms) over interleaved rounds; '/scipy' is the median of per-round "
          "ratios; 'cmp s' is the first call's time where it compiled; minimums, compile times "
          "and search steps are in the JSON.")
    for name, (specs, reason) in skipped.items():
        print(f"{name}: skipped {', '.join(specs)}: {reason}")
    _write_json(results, {name: specs for name, (specs, _) in skipped.items()})


def _write_json(results: List[Dict], skipped: Dict[str, List[str]]) -> None:
    extra = {}
    if "trained" in FLAGS.distributions:
        extra["trained_costs"] = matcher_costs.load_trained(FLAGS.trained_fixture).metadata
    timing.write_json(dict(results=results, skipped=skipped, rounds=FLAGS.rounds,
                           load_average=os.getloadavg(),
                           flags={k: FLAGS[k].value for k in (
                               "arr_passes", "unroll", "sinkhorn_epsilon", "sinkhorn_iters",
                               "seed", "variants", "distributions", "intra_op_threads")},
                           devices=[d.name for d in tf.config.list_logical_devices()], **extra),
                      FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
