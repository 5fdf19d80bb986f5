"""Shared pytest set-up (keep minimal: every engineer's tests load it).

Under KERAS_BACKEND=tensorflow, TensorFlow gets 4 logical CPU devices before
any test imports it: logical devices can only be configured before
TensorFlow runs its first op, and the TensorFlow runtime tests place
replicas on them.
"""

import os

if os.environ.get("KERAS_BACKEND") == "tensorflow":
    try:
        import tensorflow as tf
    except ImportError:  # the PyTorch-only install
        tf = None
    if tf is not None:
        _cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            if len(tf.config.get_logical_device_configuration(_cpu) or []) < 4:
                tf.config.set_logical_device_configuration(
                    _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(4)]
                )
        except RuntimeError:
            pass  # already initialised by a plugin: tests needing 4 devices will say so
