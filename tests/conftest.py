"""Test-session setup shared by every test module."""
import os

# oneDNN for every test and every process a test starts, before TensorFlow loads. TensorFlow
# turns it on by default only on some CPUs (AVX-512 and newer); on an AVX2-only AMD EPYC the
# suite ran without it, with Eigen's convolutions (about 1.9x slower on a small conv step). With
# it on, every CPU runs the suite as it was developed. It did not shorten CI there much: the
# suite still took about 43 minutes before the longest tests moved to the slow set.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# As the tools (detr_tf/cli.py): tf.keras is tf_keras, and TensorFlow does not import Keras 3
# at start, in the test processes and every process they start.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# This checkout first on every child process's path: a tool or program a test starts must import
# the package under test (and `tests`), not another installed copy of detr_tf, nor fail where
# none is installed.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != REPO])

import tensorflow as tf  # noqa: E402

from tests import suite_order  # noqa: E402

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


def pytest_collection_modifyitems(config, items):
    # The longest files first, so that none starts late and runs alone at the end.
    suite_order.longest_files_first(items)
