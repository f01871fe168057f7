"""tf-keras (legacy Keras) fit in graph mode on 2 Horovod workers x 2 virtual devices.

    horovodrun --gloo -np 2 -H localhost:2 python tests/workers/legacy_keras_multiworker_worker.py OUT_DIR

Each worker fits a Sequential classifier built under epl.replicate on its own rows
of every global batch (the batch Keras feeds is the worker's part; EPL cuts it
among its 2 replicas), and compares, after 3 steps, its weights and fit's logged
loss with the same script without EPL on the whole global batches, computed in
this same process. Writes OUT_DIR/rank<r>.json: {what: largest difference}.
"""
from __future__ import annotations

import contextlib
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"

from epl.runtime.cluster import use_virtual_cpus   # noqa: E402

use_virtual_cpus(2)

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402

import epl   # noqa: E402
from common import global_batch, write_record   # noqa: E402
from epl import env   # noqa: E402

keras = tf.keras
STEPS, ROWS, WORKERS, CLASSES = 3, 8, 2, 3   # ROWS: each worker's part of a step's batch


def fit(x, y, batch: int, use_epl: bool) -> tuple[list, list]:
    """(weights, fit's per-epoch loss) after one epoch of `batch`-row steps."""
    with tf.Graph().as_default():
        with (epl.replicate(1) if use_epl else contextlib.nullcontext()):
            model = keras.Sequential([
                keras.Input(shape=(x.shape[1],)),
                keras.layers.Dense(16, activation="relu",
                                   kernel_initializer=keras.initializers.GlorotUniform(seed=1)),
                keras.layers.Dense(CLASSES,
                                   kernel_initializer=keras.initializers.GlorotUniform(seed=2))])
        model.compile(optimizer=keras.optimizers.legacy.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        return model.get_weights(), history.history["loss"]


def main() -> None:
    out_dir = sys.argv[1]
    x, y = global_batch([STEPS * WORKERS * ROWS], CLASSES)
    expected, expected_loss = fit(x, y, WORKERS * ROWS, use_epl=False)
    epl.init(epl.Config({"cluster.virtual_devices": 2, "communication.collective_timeout_s": 60}))
    rank = epl.Cluster.current().worker_rank
    mine = np.concatenate([np.arange((step * WORKERS + rank) * ROWS,
                                     (step * WORKERS + rank + 1) * ROWS) for step in range(STEPS)])
    got, loss = fit(x[mine], y[mine], ROWS, use_epl=True)
    env.reset()
    write_record(out_dir, rank, {
        "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected)),
        "loss": float(abs(loss[0] - expected_loss[0]))})


if __name__ == "__main__":
    main()
