"""Benchmark library: FLOP counts against independent references, peak lookup, MFU, timing."""
import math
import statistics

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.benchmarks import compare, flops, synthetic, timing


def _conv_pairs_bruteforce(in_size, k, stride, pad_low, out_size):
    """Forward conv taps of one dimension that read a real (non-padding) input element."""
    return sum(1 for o in range(out_size) for j in range(k)
               if 0 <= o * stride - pad_low + j < in_size)


def test_dot_line_counts_two_flops_per_multiply_add():
    line = ("%dot.5 = f32[8,32]{1,0} dot(f32[8,16]{1,0} %a.3, f32[16,32]{1,0} %b.4), "
            "lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_type=\"MatMul\"}")
    assert flops.hlo_instruction_flops(line) == ("dot", 2 * 8 * 32 * 16)
    batched = ("%dot.1 = bf16[4,10,7]{2,1,0} dot(bf16[4,10,6]{2,1,0} %x, bf16[4,6,7]{2,1,0} %y), "
               "lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, "
               "rhs_contracting_dims={1}")
    assert flops.hlo_instruction_flops(batched) == ("dot", 2 * 4 * 10 * 7 * 6)
    assert flops.hlo_instruction_flops("%add.1 = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)") \
        == ("", 0)


def test_dense_forward_and_backward_from_hlo():
    x = tf.random.normal([6, 20])
    w = tf.Variable(tf.random.normal([20, 9]))

    def forward(x):
        return tf.matmul(x, w)

    def grads(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.matmul(x, w) ** 2)
        return tape.gradient(y, [x, w])

    fwd = 2 * 6 * 20 * 9
    assert flops.function_hlo_flops(forward, x)["total"] == fwd
    # Input and weight gradients are one product each, the size of the forward one.
    assert flops.function_hlo_flops(grads, x)["total"] == 3 * fwd


@pytest.mark.parametrize("stride,padding", [(1, "VALID"), (2, "SAME"), (2, "VALID")])
def test_conv_gradients_cost_what_the_forward_costs(stride, padding):
    """XLA's rule counts only taps on real input; the transposed and filter-gradient convs
    then touch exactly the forward's (output, tap) pairs, so train = 3 x forward."""
    x = tf.random.normal([2, 15, 12, 5])
    w = tf.Variable(tf.random.normal([3, 3, 5, 8]))
    conv = lambda x: tf.nn.conv2d(x, w, stride, padding)  # noqa: E731
    out = conv(x)
    ho, wo = out.shape[1:3]
    pads = {"VALID": (0, 0)}
    if padding == "SAME":  # TF puts the odd padding pixel at the bottom/right
        pads["SAME"] = tuple(max((o - 1) * stride + 3 - n, 0) // 2 for o, n in ((ho, 15),
                                                                              (wo, 12)))
    ph, pw = pads[padding]
    taps = (_conv_pairs_bruteforce(15, 3, stride, ph, ho)
            * _conv_pairs_bruteforce(12, 3, stride, pw, wo))
    fwd = 2 * 2 * 8 * 5 * taps

    def grads(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(conv(x) ** 2)
        return tape.gradient(y, [x, w])

    assert flops.function_hlo_flops(conv, x)["convolution"] == fwd
    assert flops.function_hlo_flops(grads, x)["convolution"] == 3 * fwd


def test_dead_gradient_code_is_not_counted():
    x = tf.random.normal([4, 10])
    w = tf.Variable(tf.random.normal([10, 10]))

    def fn(x):
        unused = tf.matmul(x, tf.transpose(x))  # noqa: F841  (traced but never read)
        return tf.matmul(x, w)

    assert flops.function_hlo_flops(fn, x)["total"] == 2 * 4 * 10 * 10


def test_resnet50_backbone_matches_the_published_count():
    # torchvision: ResNet-50 at 224x224 is 4.09 GMACs including its 2M-MAC classifier.
    b = flops.backbone_flops(flops.DetrShape(image_size=(224, 224)))
    macs = (b["frozen"] + b["trainable"]) / 2
    assert macs == pytest.approx(4.089e9 - 2048 * 1000, rel=2e-3)
    assert b["feature_hw"] == (7, 7) and b["channels"] == 2048


def test_detr_r50_forward_near_the_papers_86_gflops():
    # Carion et al. report 86 GFLOPs (multiply-adds, fvcore) for DETR-R50 on COCO val images,
    # typically resized to 800 x ~1200.
    f = flops.detr_flops(flops.DetrShape(image_size=(800, 1152)))
    assert 0.9 * 86e9 < f["forward"] / 2 < 1.1 * 86e9


def test_detr_train_is_about_three_forwards_minus_the_frozen_stem():
    s = flops.DetrShape(image_size=(256, 384), batch_size=3)
    f = flops.detr_flops(s)
    bb = flops.backbone_flops(s)
    assert f["forward"] == sum(f[k] for k in ("backbone", "input_proj", "encoder", "decoder",
                                              "heads"))
    assert f["train_step"] == 3 * f["forward"] - 2 * bb["frozen"] - bb["first_trainable_input"]
    # Linear in the batch.
    one = flops.detr_flops(flops.DetrShape(image_size=(256, 384), batch_size=1))
    assert f["train_step"] == 3 * one["train_step"]


def test_tiny_detr_hlo_count_agrees_with_the_analytic_count():
    from tests.benchmark_helpers import tiny_train_step

    ts, batch, size = tiny_train_step((96, 160))
    from detr_tf.benchmarks import ours
    shape = flops.shape_if_detr(ts.model, size, 2)  # the tools' analytic shape
    analytic = flops.detr_flops(shape)
    fwd = ours.forward_flops(ts.model, batch[0]["images"], batch[0]["pixel_mask"])
    assert fwd["total"] == analytic["forward"]
    train = ours.train_step_flops(ts, batch)
    # Exact up to the input gradients' border taps, which XLA's rule skips.
    assert train["total"] == pytest.approx(analytic["train_step"], rel=5e-3)


def test_a_model_the_analytic_count_does_not_know_has_no_shape():
    """RT-DETR has neither DETR's ResNet nor its transformer: no analytic FLOPs (the Model
    Garden comparison printed DETR-R50's for every config)."""
    import gin

    from detr_tf import config, run as run_lib

    gin.clear_config()
    try:
        config.parse_gin_config(["rtdetr_tiny.gin"], defer_required=True)
        model = run_lib.assemble().model_fn()
    finally:
        gin.clear_config()
    assert flops.shape_if_detr(model, (64, 64), 2) is None


@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA A100-SXM4-80GB", "mixed_bfloat16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "float32", 156.0),
    ("NVIDIA H100 80GB HBM3", "mixed_bfloat16", 989.0),
    ("NVIDIA H100 PCIe", "mixed_float16", 756.0),
    ("Tesla V100-SXM2-16GB", "mixed_float16", 125.0),
    ("Tesla V100-SXM2-16GB", "mixed_bfloat16", None),
    ("NVIDIA L4", "mixed_bfloat16", 121.0),
    ("Tesla T4", "float32", 8.1),
    ("Some New Accelerator", "float32", None),
])
def test_peak_lookup(name, precision, peak):
    assert flops.lookup_peak_tflops(name, precision) == peak


def test_mfu():
    assert flops.mfu(312e12, 2.0, 312.0) == pytest.approx(0.5)
    assert flops.mfu(1e12, 1.0, None) is None
    assert flops.mfu(None, 1.0, 100.0) is None


def test_latency_summary_matches_inclusive_quantiles():
    xs = [0.011, 0.013, 0.010, 0.050, 0.012, 0.014, 0.013, 0.020, 0.012, 0.011, 0.015]
    s = timing.latency_summary(xs)
    q = statistics.quantiles([x * 1e3 for x in xs], n=100, method="inclusive")
    assert s["p50_ms"] == pytest.approx(statistics.median(xs) * 1e3)
    assert s["p90_ms"] == pytest.approx(q[89])
    assert s["p99_ms"] == pytest.approx(q[98])
    assert s["mean_ms"] == pytest.approx(statistics.fmean(xs) * 1e3)
    assert s["n"] == len(xs)


def test_interleaved_rotates_the_order():
    order = []
    calls = {n: (lambda n=n: order.append(n)) for n in "abc"}
    times = timing.interleaved(calls, 3)
    assert order == list("abcbcacab")
    assert all(len(t) == 3 for t in times.values())


def test_both_synthetic_layouts_hold_the_same_boxes():
    raw = synthetic.draw(2, (64, 96), 3, 5, 10, seed=1)
    (feat, tgt), (images, labels) = synthetic.ours(raw), synthetic.model_garden(raw)
    np.testing.assert_array_equal(feat["images"].numpy(), images.numpy())
    mask = tgt["mask"].numpy()
    assert mask.sum() == 6 and not mask[:, 3:].any()
    # Model Garden: class 0 is padding, so ours + 1 on real slots; boxes (cy, cx, h, w).
    np.testing.assert_array_equal(labels["classes"].numpy(),
                                  np.where(mask, tgt["labels"].numpy() + 1, 0))
    np.testing.assert_array_equal(labels["boxes"].numpy()[..., [1, 0, 3, 2]],
                                  tgt["boxes"].numpy())


def test_variant_names_printed_in_the_table_parse_back():
    # The table names variants 'side/precision/jit=X'; that name, and the bare 'side/precision/X',
    # must select the same variant again.
    for v in compare.DEFAULT_VARIANTS:
        bare = f"{v.side}/{v.precision}/{v.jit}"
        assert compare.parse_variants([v.name, bare]) == [v, v]
    for bad in ("detr_tf/float32", "detr_tf/float32/jit=fast", "model_garden/float32/loss",
                "torch/float32/none", "detr_tf/float64/none"):
        with pytest.raises(ValueError, match="side/precision/jit"):
            compare.parse_variants([bad])


def test_ratios_pick_the_best_of_each_side():
    results = {
        "model_garden/float32/jit=none": {"images_per_sec": 0.5, "first_call_s": 80.0},
        "model_garden/float32/jit=step": {"images_per_sec": 0.4, "first_call_s": 260.0},
        "model_garden/mixed_bfloat16/jit=none": {"error": "ValueError: ..."},
        "detr_tf/float32/jit=none": {"images_per_sec": 2.0, "first_call_s": 30.0},
        "detr_tf/mixed_bfloat16/jit=loss": {"images_per_sec": 4.0, "first_call_s": 50.0},
    }
    r = compare.ratios(results)
    assert r["best_images_per_sec_ratio"] == pytest.approx(8.0)
    assert r["first_call_ratio_of_the_best"] == pytest.approx(50.0 / 80.0)
    assert r["float32/jit=none/images_per_sec_ratio"] == pytest.approx(4.0)
    assert "mixed_bfloat16/jit=none/images_per_sec_ratio" not in r
    assert math.isclose(r["float32/jit=none/first_call_ratio"], 30.0 / 80.0)


@pytest.mark.slow
def test_benchmark_train_and_infer_reports_on_the_tiny_model():
    import gin

    from detr_tf import config
    from detr_tf.benchmarks import step_benchmark

    gin.clear_config()
    config.parse_gin_config(["models/detr_tiny.gin"], ["NUM_CLASSES=3"], finalize=False)
    from detr_tf.losses import SetCriterion
    from detr_tf.modeling.detr import build_model

    batches = step_benchmark.synthetic_batches(2, (64, 96), 3, 10, 3)
    r = step_benchmark.benchmark_train(build_model, SetCriterion(), batches, steps=3, warmup=1,
                                       jit="none", precision="float32", peak_tflops=1.0,
                            log=lambda s: None)
    for key in ("images_per_sec", "step_time_ms", "compile_time_s", "flops_per_step", "mfu",
                "input_wait_share", "matching_share", "peak_host_memory_mb"):
        assert r[key] is not None, key
    assert r["images_per_sec_median_step"] == pytest.approx(2e3 / r["step_time_ms"])
    assert r["input_wait_share"] < 0.05  # synthetic input never waits
    assert r["flops_hlo_over_analytic"] == pytest.approx(1.0, rel=5e-3)
    assert r["mfu"] == pytest.approx(r["flops_per_step"] / (r["step_time_ms"] / 1e3) / 1e12)
    inf = step_benchmark.benchmark_infer(build_model, [1, 2], (64, 64), steps=3, warmup=1,
                                         jit=False, precision="float32", log=lambda s: None)
    assert [row["batch_size"] for row in inf["results"]] == [1, 2]
    for row in inf["results"]:
        assert row["p50_ms"] <= row["p90_ms"] <= row["p95_ms"] <= row["p99_ms"]
        assert inf["peak_tflops"] is None and row["mfu"] is None
    gin.clear_config()


def test_steps_per_canvas_shape_leave_out_first_appearances():
    """benchmark.py's per-canvas breakdown: shares and medians over the steps whose shape was
    already compiled, most frequent shape first."""
    from detr_tf.benchmarks import step_benchmark

    a, b = (128, 128), (128, 192)
    step_shapes = [(a, True), (b, False), (a, True), (b, True), (a, True), (b, True)]
    totals = [0.10, 9.0, 0.12, 0.20, 0.11, 0.22]
    rows = step_benchmark._by_shape(step_shapes, totals)
    assert [r["shape"] for r in rows] == [list(a), list(b)]
    assert [r["share"] for r in rows] == [0.6, 0.4]
    assert rows[0]["step_median_ms"] == pytest.approx(110.0)
    assert rows[1]["step_median_ms"] == pytest.approx(210.0)  # 9 s (the compile) left out
    assert rows[1]["step_mean_ms"] == pytest.approx(210.0)


def test_the_all_row_of_the_canvas_table_leaves_out_the_compile_too(monkeypatch):
    """The `all` row's median, like its mean and the shapes' rows, is over the steps whose
    shape was already compiled: here 120 ms, where the median of all six steps, the 9 s
    compile among them, is 160 ms."""
    from detr_tf.benchmarks import step_benchmark

    clock = [0.0]
    monkeypatch.setattr(step_benchmark.time, "perf_counter", lambda: clock[0])  # time module

    def step(batch):  # takes the time its batch says
        clock[0] += batch[1]
        return ()

    a, b = (128, 128), (128, 192)
    batch = lambda shape, seconds: ({"images": np.zeros([1, *shape, 3])}, seconds)  # noqa: E731
    timed = [batch(a, 0.10), batch(b, 9.0), batch(a, 0.12), batch(b, 0.20), batch(a, 0.11),
             batch(b, 0.22)]
    report = step_benchmark._time_steps(step, batch(a, 0.1), iter(timed), len(timed), 0, 1)
    assert report["step_time_ms"] == pytest.approx(160.0)
    # The share-weighted mean: 0.6 * 110 + 0.4 * 210 = 150 ms.
    assert step_benchmark.shape_table(report).splitlines()[-1] == "| all | 100% | 120 | 150 |"


def test_compile_benchmark_feeds_canvases_in_turn_with_unknown_height_and_width():
    from detr_tf.benchmarks import compiles
    batches = [({"images": tf.fill([2, h, w, 3], float(h * w))}, {"n": tf.constant(h)})
               for h, w in ((64, 64), (64, 128), (128, 64))]
    found = compiles.canvas_batches(iter(batches[::-1] + batches), 2)
    assert [tuple(b[0]["images"].shape[1:3]) for b in found] == [(64, 128), (128, 64)]
    fed = compiles.feed_canvases(batches, repeats=2)
    assert fed.element_spec[0]["images"].shape.as_list() == [2, None, None, 3]
    shapes = [tuple(f["images"].shape[1:3]) for f, _ in fed]
    assert shapes == [(64, 64)] * 3 + [(64, 128)] * 3 + [(128, 64)] * 3


def test_compile_table_lists_each_canvas_and_the_run_total():
    from detr_tf.benchmarks import compiles
    rows = [{"canvas": [128, 128], "first_call_s": 20.0, "step_ms": 100.0},
            {"canvas": [128, 192], "first_call_s": 1.3, "step_ms": 150.0}]
    report = {"results": [{"jit": "matcher", "canvases": rows, "compile_s": 20.9}]}
    text = compiles.table(report)
    assert "| 128 x 192 | 1.3 | 150 |" in text and "**20.9**" in text
