"""Keras 3 fit and a tf.function loop on 2 Horovod workers x 2 virtual devices each.

    horovodrun --gloo -np 2 -H localhost:2 python tests/workers/tf2_multiworker_worker.py OUT_DIR

Each worker trains the subclassed model of tests/workers/tf2_models.py on its own
half of every global batch (fit: its half is the batch fit cuts among its 2
replicas; the loop: a step drawing from its own iterator, 2 units of the script's
batch per call; "split": the same loop with the classifier under epl.split(2) over
the worker's devices), and compares its variables after 3 steps with single-device
training on the whole global batches, computed in this same process without EPL.
Writes OUT_DIR/rank<r>.json: {mode: largest difference of any variable}.
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # Keras 3

from epl.runtime.cluster import use_virtual_cpus   # noqa: E402

use_virtual_cpus(2)

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402
import keras   # noqa: E402

import epl   # noqa: E402
from common import write_record   # noqa: E402
from epl import env   # noqa: E402

import tf2_models as models   # noqa: E402

STEPS, ROWS = 3, 8   # ROWS: each worker's part of a step's batch
WORKERS = 2


def global_batches(x, y) -> list:
    """Per step, the global batch as units in order: worker 0's 2 units, then worker 1's."""
    unit = ROWS // 2
    return [[(x[(i * WORKERS * 2 + u) * unit:(i * WORKERS * 2 + u + 1) * unit],
              y[(i * WORKERS * 2 + u) * unit:(i * WORKERS * 2 + u + 1) * unit])
             for u in range(WORKERS * 2)] for i in range(STEPS)]


def mine(x, y, rank: int, mode: str):
    """This worker's rows of each step, in the order its units consume them."""
    rows = []
    for units in global_batches(x, y):
        rows.extend(units[rank * 2:(rank + 1) * 2])
    xs = np.concatenate([u[0] for u in rows])
    ys = np.concatenate([u[1] for u in rows])
    batch = ROWS if mode == "fit" else ROWS // 2
    return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch)


def train_epl(initial, x, y, rank: int, mode: str):
    epl.init(epl.Config({"cluster.virtual_devices": 2,
                         "communication.collective_timeout_s": 60}))
    model = models.custom(use_epl=True, split=mode == "split")
    model.set_weights(initial)
    data = mine(x, y, rank, mode)
    if mode == "fit":
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=models.loss_fn())
        model.fit(data, epochs=1, verbose=0, shuffle=False)
    else:
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        lossf = models.loss_fn()
        iterator = iter(data)

        @tf.function
        def step(it):
            xb, yb = next(it)
            with tf.GradientTape() as tape:
                loss = lossf(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss
        for _ in range(STEPS):
            step(iterator)
    env.reset()
    return models.weights(model)


def main() -> None:
    out_dir = sys.argv[1]
    x, y = models.data("custom", STEPS * WORKERS * ROWS)
    initial = models.custom().get_weights()
    reference = models.custom()
    reference.set_weights(initial)
    models.reference_training(reference, models.optimizer("adam"), global_batches(x, y),
                              replicas=WORKERS * 2, micro=1)
    expected = models.weights(reference)
    rank = int(os.environ["HOROVOD_RANK"])
    record = {}
    for mode in ("fit", "iterator", "split"):
        got = train_epl(initial, x, y, rank, mode)
        record[mode] = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected))
    write_record(out_dir, rank, record)


if __name__ == "__main__":
    main()
