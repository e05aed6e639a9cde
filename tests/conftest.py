"""Test-session setup shared by every test module."""
import tensorflow as tf

# Two logical CPU devices for the whole test process, so tests of replica-context code can use a
# real MirroredStrategy in-process. This must happen before anything initialises TensorFlow's
# devices, which is why it lives here rather than in the modules that need it. Code that uses
# the default device is unaffected.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
