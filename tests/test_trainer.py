"""The trainer end to end on the tiny model: engines agree, resume is exact, failures are clear.

Each run is a separate process (a runtime split into logical CPUs, Horovod, signals), so these
tests are the slowest of the default suite: about 1-2 minutes each on 2 cores.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests import tool_helpers
from tests.resume_helpers import assert_resumed_exactly, checkpoint_values
from tests.test_horovod import horovodrun_or_skip

REPO = Path(__file__).resolve().parent.parent
PROG = REPO / "tests" / "trainer_prog.py"
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO))
# For runs whose checks are about the run (its files, resume, signals, a stop) and not about the
# step's compile or the model's depth: nothing compiled, one encoder and one decoder layer (a
# third less CPU time than tiny.gin's jit='loss' and 2 + 2 layers, mostly tracing).
LIGHT = ("train.jit = 'none'", "Transformer.num_encoder_layers = 1",
         "Transformer.num_decoder_layers = 1")


@pytest.fixture(scope="module")
def shapes_cache(tmp_path_factory):
    """The tiny shapes dataset, generated once here so parallel processes never race on it."""
    from detr_tf.data import shapes

    cache = tmp_path_factory.mktemp("shapes")
    shapes.ensure_shapes_tfrecords(str(cache), num_train=64, num_val=16, image_size=128, seed=0)
    return str(cache)


def run(args, timeout=900, env=None, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=ENV if env is None else env, cwd=REPO, **kwargs)
    return proc, proc.stdout + proc.stderr


def _train_args(model_dir, cache, *params):
    """("train.py", its flags): tiny.gin on the shapes in `cache`, for tool_helpers.run_tools."""
    return ("train.py", "--gin_file=tiny.gin", f"--gin_param=SHAPES_CACHE_DIR='{cache}'",
            *[f"--gin_param={p}" for p in params], f"--model_dir={model_dir}")


def train_cli(model_dir, cache, *params):
    script, *args = _train_args(model_dir, cache, *params)
    return run([sys.executable, str(REPO / "tools" / script), *args])


def _prog(mode, name, shapes_cache, tmp_path_factory, **kwargs):
    """Runs trainer_prog.py `mode` into a new directory `name`, which it returns with its
    standard output in stdout.txt; it must succeed. kwargs go to `run` (timeout, env)."""
    out = tmp_path_factory.mktemp(name)
    proc, log = run([sys.executable, str(PROG), mode, str(out), shapes_cache], **kwargs)
    assert proc.returncode == 0, log[-4000:]
    (out / "stdout.txt").write_text(proc.stdout)
    return out


@pytest.fixture(scope="module")
def engine_runs(shapes_cache, tmp_path_factory):
    return _prog("engines", "engines", shapes_cache, tmp_path_factory)


@pytest.fixture(scope="module")
def reference_run(shapes_cache, tmp_path_factory):
    """One device, 12 steps, a checkpoint per step: only the (slow) preemption tests use it, so
    the default suite never trains it."""
    return _prog("reference", "reference", shapes_cache, tmp_path_factory) / "reference"


def _engines_pair(shapes_cache, tmp_path_factory, variant, mode="engines_pair"):
    """One-device and mirrored runs of trainer_prog.py's TRAINER_PROG_VARIANT `variant` (mode
    'engines_jit': and a jit='step' one)."""
    return _prog(mode, f"engines_{variant}", shapes_cache, tmp_path_factory, timeout=2400,
                 env=dict(ENV, TRAINER_PROG_VARIANT=variant))


@pytest.fixture(scope="module")
def group_dn_runs(shapes_cache, tmp_path_factory):
    """One-device and mirrored runs of the tiny model with 2 query groups and denoising."""
    return _engines_pair(shapes_cache, tmp_path_factory, "group_dn")


GROUP_DN_ENV = dict(ENV, TRAINER_PROG_VARIANT="group_dn")


def _assert_same_training(ref_dir, other_dir, rtol=1e-5):
    ref, other = np.load(ref_dir / "result.npz"), np.load(other_dir / "result.npz")
    # Same global batch -> same loss at every step (float32 reduction order aside).
    np.testing.assert_allclose(other["losses"], ref["losses"], rtol=rtol)
    # The boxes cut by build_dataset.max_boxes: every replica's and micro-batch's, counted.
    np.testing.assert_array_equal(other["cuts"], ref["cuts"])
    names = [k for k in ref.files if k not in ("losses", "cuts") and not k.startswith("step1/")]
    _assert_same_weights({k: ref[k] for k in names}, {k: other[k] for k in other.files},
                         {k: ref["step1/" + k] for k in names})


def _assert_same_weights(ref, other, ref_before):
    """`other` equals `ref` up to far less than one step's update (ref - ref_before)."""
    names = list(ref)
    assert len(names) > 100 and set(names) <= set(other)
    update = max(np.abs(ref[k] - ref_before[k]).max() for k in names)
    assert update > 1e-5
    # The weights differ by far less than one step changes them (1%), up to a few float32 ulps
    # (reductions in another order round differently). Not less than 1%: torch.optim.AdamW's
    # update g / (|g| + eps) turns gradients that are pure rounding noise (e.g. the key
    # projection's bias gets a true gradient of zero: softmax ignores it) into steps of up to lr,
    # so a sum in another order moves such weights by ~0.1% of a step (measured with both forms
    # of the fused update; tf_keras's eps-hat form, 30x larger eps at first, damped it to
    # ~0.002%).
    for k in names:
        tol = 1e-2 * update + 4 * np.finfo(np.float32).eps * np.abs(ref[k])
        excess = np.abs(ref[k] - other[k]) - tol
        assert np.all(excess <= 0), (k, float(np.abs(ref[k] - other[k]).max()), update)


def _model_weights(ckpt):
    reader = tf.train.load_checkpoint(str(ckpt))
    return {n: reader.get_tensor(n) for n, _ in tf.train.list_variables(str(ckpt))
            if n.startswith("model/") and "OPTIMIZER_SLOT" not in n}


def _losses(model_dir):
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def _preempt_then_resume(launch, out, reference):
    """A 2-process run gets SIGTERM on worker 1 only: both workers stop after the same step S
    and the chief's checkpoint of S exists; restarted to S + 2, every worker resumes at S and
    the run ends with the uninterrupted single-device reference's weights and losses.

    launch(num_steps) starts the job and returns its Popen objects.
    """
    run_dir = out / "run"
    procs = launch(1000)
    deadline = time.time() + 600
    # Signal once the chief has logged a step (everyone has then compiled and trained).
    while not ((run_dir / "metrics.jsonl").exists()
               and (run_dir / "metrics.jsonl").read_text().strip()):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "no step logged"
        time.sleep(0.05)
    os.kill(int((out / "pid_1").read_text()), signal.SIGTERM)
    logs = [p.communicate(timeout=600)[0] for p in procs]
    log = "\n".join(logs)
    assert all(p.returncode == 0 for p in procs), log[-6000:]

    def results(log):
        found = [json.loads(line.split("PREEMPT_RESULT ", 1)[1])
                 for line in log.splitlines() if "PREEMPT_RESULT " in line]
        assert sorted(r["rank"] for r in found) == [0, 1], log[-6000:]
        return {r["rank"]: r["step"] for r in found}

    steps = results(log)
    stop = steps[0]
    assert steps[1] == stop and 1 <= stop <= 10, steps  # the reference has 12 steps
    assert "termination signal received; saved" in log
    assert "worker 1: termination signal received (here)" in log, log[-6000:]
    ckpt = tf.train.latest_checkpoint(str(run_dir / "checkpoints"))
    assert ckpt.endswith(f"ckpt-{stop}")
    assert int(tf.train.load_checkpoint(ckpt).get_tensor(
        "global_step/.ATTRIBUTES/VARIABLE_VALUE")) == stop

    procs = launch(stop + 2)
    log = "\n".join(p.communicate(timeout=600)[0] for p in procs)
    assert all(p.returncode == 0 for p in procs), log[-6000:]
    assert f"at step {stop}" in log and f"worker 1 resumed at step {stop}" in log, log[-6000:]
    assert results(log) == {0: stop + 2, 1: stop + 2}
    end = stop + 2
    ref_ckpts = reference / "checkpoints"
    _assert_same_weights(_model_weights(ref_ckpts / f"ckpt-{end}"),
                         _model_weights(run_dir / "checkpoints" / f"ckpt-{end}"),
                         _model_weights(ref_ckpts / f"ckpt-{end - 1}"))
    ref_losses, losses = _losses(reference), _losses(run_dir)
    assert sorted(losses) == list(range(1, end + 1))
    np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                               [ref_losses[s] for s in sorted(losses)], rtol=1e-5)


def test_mirrored_two_replicas_equals_one_device(engine_runs):
    _assert_same_training(engine_runs / "default", engine_runs / "mirrored")
    assert np.load(engine_runs / "default" / "result.npz")["cuts"].sum() > 0


@pytest.fixture(scope="module")
def tf_keras_runs(shapes_cache, tmp_path_factory):
    """One-device and mirrored runs with tf_keras's AdamW (build_optimizers.fused = False)."""
    return _engines_pair(shapes_cache, tmp_path_factory, "tf_keras")


# tf_keras's own AdamW on the engines: slow (a pair of runs of their own), so `pytest -m slow -k
# tf_keras tests/test_trainer.py`.
@pytest.mark.slow
def test_tf_keras_adamw_mirrored_two_replicas_equals_one_device(tf_keras_runs):
    _assert_same_training(tf_keras_runs / "default", tf_keras_runs / "mirrored")


@pytest.mark.slow
def test_a_tf_keras_run_is_not_resumed_by_the_fused_update(tf_keras_runs, shapes_cache):
    run_dir = tf_keras_runs / "default"
    before = sorted(os.listdir(run_dir / "checkpoints"))
    proc, log = train_cli(run_dir, shapes_cache, "train.num_steps = 4")
    assert proc.returncode != 0 and "Traceback" not in log, log[-3000:]
    assert "build_optimizers.fused = False to resume it" in log, log[-3000:]
    assert sorted(os.listdir(run_dir / "checkpoints")) == before  # nothing saved or lost


# Query groups and denoising queries (their losses and all-reduced normalizers) on every
# engine: slow (each pair of runs compiles the model anew, ~2 min), so `pytest -m slow -k
# group_dn tests/test_trainer.py`.
@pytest.mark.slow
def test_group_dn_mirrored_two_replicas_equals_one_device(group_dn_runs):
    _assert_same_training(group_dn_runs / "default", group_dn_runs / "mirrored")


@pytest.mark.slow
@pytest.mark.horovod
def test_group_dn_horovod_two_processes_equals_one_device(group_dn_runs, shapes_cache):
    exe = horovodrun_or_skip()
    proc, log = run([exe, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(PROG),
                     "horovod", str(group_dn_runs), shapes_cache], env=GROUP_DN_ENV)
    assert proc.returncode == 0, log[-4000:]
    _assert_same_training(group_dn_runs / "default", group_dn_runs / "horovod")


@pytest.mark.slow
def test_group_dn_multi_worker_two_processes_equals_one_device(group_dn_runs, shapes_cache):
    _run_multi_worker(group_dn_runs, shapes_cache, env=GROUP_DN_ENV)
    _assert_same_training(group_dn_runs / "default", group_dn_runs / "multi_worker")


@pytest.fixture(scope="module", params=["rtdetr", "dfine", "dfine_deim", "dino_family",
                                        "co_dino"])
def rtdetr_runs(request, shapes_cache, tmp_path_factory):
    """RT-DETR (rtdetr_tiny.gin), D-FINE (dfine_tiny.gin: the union's box losses, whose
    normalizer the step averages over the replicas), D-FINE with DEIM's loss and rate, or DINO
    with the family's options (trainer_prog.py's dino_family), or Co-DINO (co_dino: its
    runs but jit='step' compile only the matcher, its loss all-reducing),
    denoising noise off: jit='step' on one device, then one-device and mirrored runs with
    jit='loss' (trainer_prog.py engines_jit)."""
    return _engines_pair(shapes_cache, tmp_path_factory, request.param, mode="engines_jit")


def _variant_env(request):
    return dict(ENV, TRAINER_PROG_VARIANT=request.node.callspec.params["rtdetr_runs"])


# RT-DETR and D-FINE on the engines and under jit='step': slow (three runs in one process per
# model, each compiling it anew; 5.5 min for RT-DETR on a shared 2-core CPU; two processes for
# the multi-process engines), so `pytest -m slow -k rtdetr tests/test_trainer.py` (`-k dfine`:
# D-FINE's only; `-k dino_family`: DINO's with the family's options; `-k co_dino`: Co-DINO's,
# docs/MODEL.md, "Co-DETR").
@pytest.mark.slow
def test_rtdetr_mirrored_two_replicas_equals_one_device(rtdetr_runs):
    # Its batch norms train on batch statistics: equal only if the replicas share them.
    _assert_same_training(rtdetr_runs / "default", rtdetr_runs / "mirrored")


@pytest.mark.slow
def test_rtdetr_multi_worker_two_processes_equals_one_device(rtdetr_runs, shapes_cache,
                                                             request):
    _run_multi_worker(rtdetr_runs, shapes_cache, env=_variant_env(request), timeout=1800)
    _assert_same_training(rtdetr_runs / "default", rtdetr_runs / "multi_worker")


@pytest.mark.slow
@pytest.mark.horovod
def test_rtdetr_horovod_jit_step_trains_like_loss(rtdetr_runs, shapes_cache, request):
    """Two Horovod processes (each normalizes its batch norms with its own half of the batch,
    so not one device's training): jit='step' as 'loss'. D-FINE's union count is averaged
    over the processes between its compiled forward pass and the backward pass."""
    exe = horovodrun_or_skip()
    proc, log = run([exe, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(PROG),
                     "horovod_jit", str(rtdetr_runs), shapes_cache], timeout=1800,
                    env=_variant_env(request))
    assert proc.returncode == 0, log[-4000:]
    _assert_same_training(rtdetr_runs / "horovod_loss", rtdetr_runs / "horovod_step",
                          rtol=1e-4)


@pytest.mark.slow
def test_rtdetr_jit_step_trains_like_loss(rtdetr_runs):
    # XLA fuses and reorders float32 arithmetic: equal up to rounding, as for DETR.
    _assert_same_training(rtdetr_runs / "default", rtdetr_runs / "step", rtol=1e-4)


@pytest.mark.slow
def test_rtdetr_losses_finite_batch_norm_statistics_trained_and_restored(rtdetr_runs,
                                                                          request):
    run_dir = rtdetr_runs / "default"
    result = np.load(run_dir / "result.npz")
    assert result["losses"].size == 2 and np.all(np.isfinite(result["losses"]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(v) for r in records for k, v in r.items()
               if k.startswith("loss") and isinstance(v, float))
    # The encoder's moving statistics start at mean 0 / variance 1 and move at every step.
    moving = [k for k in result.files if k.startswith("model/encoder/")
              and ("moving_mean" in k or "moving_variance" in k)]
    # DINO's encoder normalizes with GroupNorm (and its ResNet's batch norms are frozen).
    dino = request.node.callspec.params["rtdetr_runs"] in ("dino_family", "co_dino")
    assert (moving == []) if dino else (len(moving) > 10), moving
    for k in moving:
        start = 0.0 if "moving_mean" in k else 1.0
        assert np.abs(result["step1/" + k] - start).max() > 0, k
        assert np.abs(result[k] - result["step1/" + k]).max() > 0, k
    # The model the tools restore holds the checkpoint's every value, moving statistics too.
    saved = _model_weights(run_dir / "checkpoints" / "ckpt-2")
    restored = _model_weights(rtdetr_runs / "restored" / "ckpt")
    assert set(restored) == set(saved)
    for k, v in saved.items():
        np.testing.assert_array_equal(restored[k], v, err_msg=k)


def test_gradient_accumulation_equals_one_larger_batch(engine_runs):
    _assert_same_training(engine_runs / "default", engine_runs / "accumulated")


def test_every_engine_names_the_first_step_that_cut_target_boxes(engine_runs):
    """The engine runs keep 3 target slots of the shapes images' 1-6 boxes: each run names the
    boxes cut once, at the first step that cut any (step 2: the first global batch has no image
    of more than 3), with their count over the replicas and micro-batches."""
    said = (engine_runs / "stdout.txt").read_text()
    for name in ("default", "mirrored", "accumulated"):  # trainer_prog.py prints each at its end
        run_said, said = said.split(f"\n{name} [", 1)
        cuts = np.load(engine_runs / name / "result.npz")["cuts"]
        assert cuts.shape == (2,) and cuts[0] == 0 and cuts[1] > 0, (name, cuts)
        assert run_said.count("target boxes beyond build_dataset.max_boxes were cut") == 1, \
            run_said[-3000:]
        assert f"step 2: {int(cuts[1])} target boxes" in run_said, run_said[-3000:]


# Two-process engines against one device: slow (each starts two TensorFlow processes that
# compile and train), so `pytest -m slow -k two_processes tests/test_trainer.py`. Mirrored and
# gradient accumulation stay in the default suite, and so does tests/test_horovod.py.
@pytest.mark.slow
@pytest.mark.horovod
def test_horovod_two_processes_equals_one_device(engine_runs, shapes_cache):
    exe = horovodrun_or_skip()
    proc, log = run([exe, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(PROG),
                     "horovod", str(engine_runs), shapes_cache])
    assert proc.returncode == 0, log[-4000:]
    _assert_same_training(engine_runs / "default", engine_runs / "horovod")


# Preemption of one of two processes: slow (two jobs each, started, signalled and resumed), so
# `pytest -m slow -k preempted tests/test_trainer.py`. The single-process SIGTERM test below
# stays in the default suite.
@pytest.mark.slow
@pytest.mark.horovod
def test_horovod_preempted_on_one_rank_stops_all_and_resumes_exactly(reference_run, shapes_cache,
                                                                     tmp_path):
    def launch(num_steps):
        return launch_two("horovod", [str(PROG), "preempt", str(tmp_path), shapes_cache,
                                      str(num_steps)])

    _preempt_then_resume(launch, tmp_path, reference_run)


@pytest.mark.slow
def test_multi_worker_preempted_on_one_worker_stops_all_and_resumes_exactly(
        reference_run, shapes_cache, tmp_path):
    def launch(num_steps):
        return launch_two("multi_worker", [str(PROG), "preempt", str(tmp_path), shapes_cache,
                                           str(num_steps)])

    _preempt_then_resume(launch, tmp_path, reference_run)


def _free_ports(n):
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run_multi_worker(out_dir, shapes_cache, env=None, timeout=900):
    """trainer_prog.py's 'multi_worker' runs into out_dir: two workers, both must succeed."""
    procs = launch_two("multi_worker", [str(PROG), "multi_worker", str(out_dir), shapes_cache],
                       env=env)
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]


def launch_two(engine, argv, env=None):
    """Starts `argv` (a Python program and its arguments) as a job of 2 processes: under
    horovodrun with Gloo (engine 'horovod'; the test is skipped without Horovod) or as two
    MultiWorkerMirrored workers on free local ports, each with its TF_CONFIG ('multi_worker').
    Returns the Popen objects, stdout and stderr merged."""
    env = ENV if env is None else env

    def start(args, env):
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=REPO)

    if engine == "horovod":
        return [start([horovodrun_or_skip(), "-np", "2", "-H", "localhost:2", "--gloo",
                       sys.executable, *argv], env)]
    assert engine == "multi_worker", engine
    cluster = {"worker": [f"localhost:{p}" for p in _free_ports(2)]}
    return [start([sys.executable, *argv], dict(env, TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": i}}))) for i in range(2)]


@pytest.mark.slow
def test_multi_worker_two_processes_equals_one_device(engine_runs, shapes_cache):
    _run_multi_worker(engine_runs, shapes_cache)
    # Only the chief (worker 0) wrote checkpoints and logs.
    assert not (engine_runs / "worker_1" / "metrics.jsonl").exists()
    _assert_same_training(engine_runs / "default", engine_runs / "multi_worker")


def test_run_outputs_and_exact_resume(shapes_cache, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    base = (*LIGHT, "train.deterministic = True", "train.checkpoint_every = 2")
    common = (*base, "train.num_steps = 4", "train.log_every = 1")
    # The uninterrupted run, and the interrupted one's first 2 steps, in one process
    # (tools/train.py's main twice; flags, Gin and Keras reset between); the resume below starts
    # a process of its own, as after a preemption. tiny.gin does not evaluate, so a binding of
    # the evaluation is never used: said at the end.
    proc, interrupted = tool_helpers.run_tools(
        _train_args(full, shapes_cache, *common, "coco_evaluate.batch_size = 2"),
        _train_args(part, shapes_cache, *base, "train.num_steps = 2"))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "detr_tf: note: --gin_param coco_evaluate.batch_size was not used" in log, log[-4000:]
    # The last line says how long the run took, and where the time went.
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("detr_tf: done in ") and "4 steps" in last, last

    # config.gin at start, operative_config.gin (what was actually called) after step one.
    config_gin = (full / "config.gin").read_text()
    assert "train.num_steps = 4" in config_gin
    operative = (full / "operative_config.gin").read_text()
    assert "SetCriterion.eos_coef = 0.1" in operative and "build_optimizers." in operative
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert np.isfinite(r["loss"]) and r["split"] == "train"
        assert {"loss_ce", "loss_bbox", "loss_giou", "class_error", "cardinality_error",
                "grad_norm", "learning_rate", "backbone_learning_rate",
                "images_per_sec"} <= set(r)
        assert r["targets_cut"] == 0  # at most 6 shapes an image, 16 target slots
    assert "target boxes beyond" not in log
    assert any(f.startswith("events.") for f in os.listdir(full / "train"))

    # Interrupted after 2 steps, resumed to 4 (dropout on): the uninterrupted run's weights and
    # losses (tests/resume_helpers.py; tests/test_resume.py runs it on 2 processes too).
    assert interrupted.returncode == 0, (interrupted.stdout + interrupted.stderr)[-4000:]
    proc, log = train_cli(part, shapes_cache, *common)
    assert proc.returncode == 0 and "resumed from" in log and "at step 2" in log, log[-4000:]
    assert_resumed_exactly(full, part, 2, 4)
    # One process sums in one order: bit for bit, optimizer slots included.
    a, b = checkpoint_values(full, 4), checkpoint_values(part, 4)
    for name in (n for n in a if n.startswith("model/")):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

    # Two refused resumes, in one process (tools/train.py's main twice, flags and Gin reset
    # between): a binding that fails while the run is built, and another batch size, refused
    # before anything is built (the input position and the epoch schedule count steps of the
    # recorded size). Each says one line, and the run keeps the config.gin its checkpoints
    # were trained with, and its checkpoints.
    saved = sorted(os.listdir(full / "checkpoints"))
    resume = (*base, "train.num_steps = 6")
    bad_binding, other_batch = tool_helpers.run_tools(
        _train_args(full, shapes_cache, *resume, "build_optimizers.warmup_steps = -1"),
        _train_args(full, shapes_cache, *resume, "GLOBAL_BATCH_SIZE = 2"))
    log = bad_binding.stdout + bad_binding.stderr
    assert bad_binding.returncode == 1 and "Traceback" not in log, log[-4000:]
    assert "build_optimizers.warmup_steps = -1 (int) must be an int >= 0" in log, log[-4000:]
    log = other_batch.stdout + other_batch.stderr
    assert other_batch.returncode == 1 and "Traceback" not in log, log[-4000:]
    assert "trained to step 4 at 4 images per step" in log and "gives 2" in log, log[-4000:]
    assert (full / "config.gin").read_text() == config_gin
    assert sorted(os.listdir(full / "checkpoints")) == saved


def _nan_runs(shapes_cache, out, policies):
    """trainer_prog.py's runs whose loss turns NaN at step 3, one per NaN policy: (their
    results, their standard output)."""
    proc, log = run([sys.executable, str(PROG), "nan", str(out), shapes_cache, policies])
    assert proc.returncode == 0, log[-4000:]
    return json.loads(log.split("NAN_RESULT ", 1)[1].splitlines()[0]), proc.stdout


@pytest.fixture(scope="module")
def nan_stop_run(shapes_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("nan")
    results, said = _nan_runs(shapes_cache, out, "stop")
    return out / "stop", results["stop"], said


def test_nan_loss_stops_naming_step_and_terms(nan_stop_run):
    _, stop, _ = nan_stop_run
    # The third step's loss is NaN: the run stops there, names it and its terms, and the
    # checkpoints of the two good steps are intact.
    assert "non-finite loss at step 3" in stop["error"] and "loss_giou=" in stop["error"]
    assert stop["latest"].endswith("ckpt-2")
    reader = tf.train.load_checkpoint(stop["latest"])
    assert all(np.all(np.isfinite(reader.get_tensor(n)))
               for n, _ in tf.train.list_variables(stop["latest"]) if n.startswith("model/"))


def test_target_boxes_cut_by_max_boxes_are_counted_and_named_once(nan_stop_run):
    # The NaN run keeps one target slot of the shapes images' 1-6 boxes: every step cuts some.
    run_dir, _, said = nan_stop_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2], records
    assert [r["targets_cut"] > 0 for r in records] == [True, True], records
    assert said.count("target boxes beyond build_dataset.max_boxes were cut") == 1, said[-4000:]
    assert f"step 1: {int(records[0]['targets_cut'])} target boxes" in said, said[-4000:]


# The policy 'skip' on the tiny DETR: slow (a run of its own). The default suite runs it in the
# trainer on a toy model: tests/test_steps_per_loop.py's
# test_nan_mid_loop_skipped_is_reported_and_the_run_goes_on.
@pytest.mark.slow
def test_nan_loss_skipped_the_run_goes_on(shapes_cache, tmp_path):
    skip = _nan_runs(shapes_cache, tmp_path, "skip")[0]["skip"]
    assert skip["error"] is None and skip["latest"].endswith("ckpt-4")


def test_sigterm_saves_a_restorable_checkpoint_and_exits_cleanly(shapes_cache, tmp_path):
    args = [sys.executable, str(REPO / "tools" / "train.py"), "--gin_file=tiny.gin",
            f"--gin_param=SHAPES_CACHE_DIR='{shapes_cache}'", "--gin_param=train.num_steps=100000",
            "--gin_param=train.checkpoint_every=100000", *[f"--gin_param={p}" for p in LIGHT],
            f"--model_dir={tmp_path}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV, cwd=REPO)
    deadline = time.time() + 600
    for line in proc.stdout:
        if "step 1/" in line or time.time() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "termination signal received; saved" in out
    ckpt = tf.train.latest_checkpoint(os.path.join(tmp_path, "checkpoints"))
    step = int(ckpt.rsplit("-", 1)[1])
    assert step >= 1
    reader = tf.train.load_checkpoint(ckpt)
    assert int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE")) == step


def test_missing_data_and_unwritable_model_dir_fail_before_compiling(tmp_path):
    missing = tmp_path / "nowhere"
    proc, log = run([sys.executable, str(REPO / "tools" / "train.py"), "--gin_file=tiny.gin",
                     f"--gin_param=train/TFRecordSource.file_pattern = '{missing}/*.tfrecord'",
                     "--gin_param=TRAIN_DATA = @train/TFRecordSource()",
                     f"--model_dir={tmp_path / 'run'}"], timeout=300)
    assert proc.returncode != 0 and "Traceback" not in log, log[-3000:]
    assert str(missing) in log

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc, log = run([sys.executable, str(REPO / "tools" / "train.py"), "--gin_file=tiny.gin",
                     f"--model_dir={blocker / 'run'}"], timeout=300)
    assert proc.returncode != 0 and "is a file" in log and "Traceback" not in log, log[-3000:]
