"""Test-session setup shared by every test module."""
import os

# oneDNN for every test and every process a test starts, before TensorFlow loads. TensorFlow
# turns it on by default only on some CPUs (AVX-512 and newer); on an AVX2-only AMD EPYC the
# suite ran without it, with Eigen's convolutions (about 1.9x slower on a small conv step). With
# it on, every CPU runs the suite as it was developed. It did not shorten CI there much: the
# suite still took about 43 minutes before the longest tests moved to the slow set.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import tensorflow as tf  # noqa: E402

# Two logical CPU devices for the whole test process, so tests of replica-context code can use a
# real MirroredStrategy in-process. This must happen before anything initialises TensorFlow's
# devices, which is why it lives here rather than in the modules that need it. Code that uses
# the default device is unaffected.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])


def pytest_configure(config):
    # The slowest tests at the end of every run, CI's included, so that a suite that grows past
    # its time budget shows where the time went (`pytest --durations=N` still overrides it).
    if config.option.durations is None:
        config.option.durations = 25


# The longest test files, longest first (per-file sums of `pytest -n 0 --durations=0` on an idle
# 2-core AVX2 CPU). Under `--dist loadfile` a file runs whole on one worker, and a worker takes
# the next file in collection order as it runs out of work; started late, the longest file would
# run alone at the end. So they are collected first (LPT scheduling), and xdist keeps that order
# (`--no-loadscope-reorder` in pyproject.toml; by default it orders files by their test count).
LONGEST_FILES = ("test_trainer.py", "test_trainer_paths.py", "test_tools_e2e.py",
                 "test_matching.py", "test_weights_cli.py", "test_benchmarks.py",
                 "test_console.py", "test_config.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
