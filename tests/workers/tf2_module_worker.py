"""A tf.Module model with hand-written updates, and a retrace, in eager TensorFlow 2.

    python tests/workers/tf2_module_worker.py

A plain `tf.Module` MLP of `tf.Variable`s, a `tf.function` step with GradientTape
that updates the variables by hand (`v.assign_sub(lr * g)`), data parallelism over
2 virtual devices. The step is called with a batch of 16 rows, then of 8 (a
retrace: a new input signature, rewritten too), then from a tf.data iterator in a
second step function. The script keeps a running sum of the loss in a
`tf.Variable` (`loss_sum.assign_add(loss)`, each step's loss of the global batch,
as single-device training adds it). Prints `DIFF <case> <largest difference from
single-device training on the same batches>`, `TRACES <rewritten traces>`, and
`REFUSED rows_seen: ...` for a step that adds up its batch's values in a plain
variable (one replica's values: EPL refuses it, naming the variable), then
`DIFF rows_seen ...` for the same variable declared summed over replicas.
"""
from __future__ import annotations

import os

os.environ.pop("TF_USE_LEGACY_KERAS", None)

from epl.runtime.cluster import use_virtual_cpus   # noqa: E402

use_virtual_cpus(2)

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402

import epl   # noqa: E402
from epl import env   # noqa: E402
from epl.runtime import eager_state   # noqa: E402

LR = 0.1


class MLP(tf.Module):
    """Two dense layers of plain variables."""

    def __init__(self):
        super().__init__()
        rng = np.random.RandomState(0)
        self.w1 = tf.Variable(rng.randn(6, 16).astype(np.float32) * 0.4)
        self.b1 = tf.Variable(np.zeros(16, np.float32))
        self.w2 = tf.Variable(rng.randn(16, 3).astype(np.float32) * 0.4)
        self.loss_sum = tf.Variable(0.0, trainable=False)

    def __call__(self, x):
        return tf.matmul(tf.nn.tanh(tf.matmul(x, self.w1) + self.b1), self.w2)


def loss_of(model, x, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x)))


def train_step(model, x, y):
    with tf.GradientTape() as tape:
        loss = loss_of(model, x, y)
    for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
        v.assign_sub(LR * g)
    model.loss_sum.assign_add(loss)
    return loss


def run(batches, iterator_rows: int):
    """Train on `batches` (tensors passed in), then 2 steps drawn from an iterator of
    `iterator_rows`-row batches; returns the variables."""
    model = MLP()
    step = tf.function(lambda x, y: train_step(model, x, y))
    for x, y in batches:
        step(tf.constant(x), tf.constant(y))
    rng = np.random.RandomState(5)
    data = tf.data.Dataset.from_tensor_slices((rng.randn(64, 6).astype(np.float32),
                                               rng.randint(0, 3, 64))).batch(iterator_rows)
    iterator = iter(data)

    @tf.function
    def drawn(it):
        x, y = next(it)
        return train_step(model, x, y)
    for _ in range(2):
        drawn(iterator)
    return [v.numpy() for v in model.trainable_variables] + [model.loss_sum.numpy()]


def rows_seen(aggregation=tf.VariableAggregation.NONE) -> None:
    """A step that adds up the values of its batch in a variable: refused in a plain one;
    declared summed (the refusal's remedy), it holds the sum over the global batch."""
    model = MLP()
    seen = tf.Variable(0.0, trainable=False, aggregation=aggregation)

    @tf.function
    def step(x, y):
        loss = train_step(model, x, y)
        seen.assign_add(tf.reduce_sum(x))
        return loss
    rng = np.random.RandomState(2)
    x = rng.randn(8, 6).astype(np.float32)
    try:
        step(tf.constant(x), tf.constant(rng.randint(0, 3, 8)))
    except epl.EPLError as err:
        print(f"REFUSED rows_seen: {type(err).__name__}: {err}", flush=True)
    else:
        # a float32 sum in another order: within len(x) roundings of sum|x|
        bound = x.size * np.finfo(np.float32).eps * float(np.abs(x).sum())
        print("DIFF rows_seen", abs(float(seen.numpy()) - float(x.astype(np.float64).sum())),
              bound, flush=True)


def main() -> None:
    rng = np.random.RandomState(1)
    batches = [(rng.randn(16, 6).astype(np.float32), rng.randint(0, 3, 16)),
               (rng.randn(8, 6).astype(np.float32), rng.randint(0, 3, 8))]
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    got = run(batches, iterator_rows=4)   # each of the 2 replicas draws 4 rows
    traces = eager_state.StepState.created
    env.reset()
    want = run(batches, iterator_rows=8)  # single-device: both replicas' 8 rows
    print("DIFF module", max(float(np.max(np.abs(a - b))) for a, b in zip(got, want)))
    print("TRACES", traces)
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    rows_seen()
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    rows_seen(tf.VariableAggregation.SUM)


if __name__ == "__main__":
    main()
