"""What EPL refuses in eager TensorFlow 2 programs, in a Keras 3 process.

    python tests/workers/tf2_refusals_worker.py [--late-init]

Prints one `REFUSED <case>: <type>: <message>` line per case (a case that runs
instead prints `RAN <case>`): a custom train_step under fit whose loss metric reads the split classifier's loss
while the body runs under epl.replicate; with --late-init, a step traced when TensorFlow
ran an op before epl.init could create its devices.
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # Keras 3

from epl.runtime.cluster import use_virtual_cpus   # noqa: E402

LATE = "--late-init" in sys.argv
if not LATE:
    use_virtual_cpus(2)

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402
import keras   # noqa: E402

import epl   # noqa: E402
from epl import env   # noqa: E402


def case(name: str, fn) -> None:
    try:
        fn()
    except epl.EPLError as err:
        print(f"REFUSED {name}: {type(err).__name__}: {err}", flush=True)
    else:
        print(f"RAN {name}", flush=True)
    env.reset()


def split_loss_metric_in_a_custom_fit() -> None:
    """tests/workers/tf2_models.py's subclassed model: its train_step updates the loss
    tracker from the loss the split classifier computes (once, over the batch fit
    passes in), beside the metrics the replicated body updates per replica."""
    import tf2_models as models
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    model = models.custom(use_epl=True, split=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=models.loss_fn())
    x, y = models.data("custom", 8)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def late_init() -> None:
    tf.constant(1.0)   # TensorFlow initializes its devices: one CPU
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    w = tf.Variable(tf.ones([4, 2]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(x, w))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss
    step(tf.ones([4, 4]))


if __name__ == "__main__":
    if LATE:
        case("late_init", late_init)
    else:
        case("split_loss_metric_in_a_custom_fit", split_loss_metric_in_a_custom_fit)
