"""Keras 3 fit and a tf.function loop on 2 Horovod workers x 2 virtual devices each.

    horovodrun --gloo -np 2 -H localhost:2 python tests/workers/tf2_multiworker_worker.py OUT_DIR

Each worker trains the subclassed model of tests/workers/tf2_models.py on its own
half of every global batch (fit: its half is the batch fit cuts among its 2
replicas; the loop: a step drawing from its own iterator, 2 units of the script's
batch per call; "split": the same loop with the classifier under epl.split(2) over
the worker's devices; "split_embedding": the loop on the transformer with its
embeddings and classifier under epl.split(2)), and compares its variables after 3
steps with single-device training on the whole global batches, computed in this
same process without EPL. Writes OUT_DIR/rank<r>.json: {mode: largest difference of
any variable}, and for "split_embedding" [difference, noise floor] per variable.
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
    if mode == "split_embedding":
        model = models.transformer(use_epl=True, split="embedding")
    else:
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


def reference(name: str, initial, x, y, reverse: bool = False) -> list:
    """The variables of single-device training of model `name` on the global batches
    (`reverse`: each unit's gradient taken on its own and added in the other order,
    the same function with another rounding: the noise floor)."""
    model = models.MODELS[name]()
    model.set_weights(initial)
    models.reference_training(model, models.optimizer("adam"), global_batches(x, y),
                              replicas=WORKERS * 2, micro=1, reverse=reverse)
    return models.weights(model)


def main() -> None:
    out_dir = sys.argv[1]
    rank = int(os.environ["HOROVOD_RANK"])
    record = {}
    x, y = models.data("custom", STEPS * WORKERS * ROWS)
    initial = models.custom().get_weights()
    expected = reference("custom", initial, x, y)
    for mode in ("fit", "iterator", "split"):
        got = train_epl(initial, x, y, rank, mode)
        record[mode] = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected))
    # the transformer with its embeddings and classifier under epl.split: per variable,
    # the difference and the noise floor (the reversed reference's difference)
    x, y = models.data("transformer", STEPS * WORKERS * ROWS)
    initial = models.transformer().get_weights()
    expected = reference("transformer", initial, x, y)
    other = reference("transformer", initial, x, y, reverse=True)
    got = train_epl(initial, x, y, rank, "split_embedding")
    record["split_embedding"] = [
        [float(np.max(np.abs(a - b))) if a.size else 0.0,
         float(np.max(np.abs(c.astype(np.float64) - b))) if a.size else 0.0]
        for a, b, c in zip(got, expected, other)]
    write_record(out_dir, rank, record)


if __name__ == "__main__":
    main()
