"""The TensorFlow 2 oracle, in its own process (Keras 3: no TF_USE_LEGACY_KERAS).

    python tests/workers/tf2_worker.py --cases convnet:fit:dp,custom:iterator:zero --out FILE

For each case (a model of tests/workers/tf2_models.py, a mode, a strategy), trains
STEPS steps under EPL and single-device on the batches the units consumed, and
writes FILE (npz), per case C = "model:mode:strategy": `C/losses` (the running mean
loss after each step, as Keras logs it), `C/var_<i>` (every variable after
training), `C/rewrites` (how many traced steps EPL rewrote), `C/state` (the names
of the variables EPL created for them), `C/split_ops` ("type slot device" of the
split ops in the rewritten functions), `C/unsharded` (the
SplitUnshardedVariableWarning messages), `C/reference` (the key R of the reference),
and for each reference `R/losses`, `R/var_<i>` and its noise floor `R/reversed/...`.

Modes: `fit` (model.compile + model.fit on a tf.data.Dataset of global batches);
`tensors` (a tf.function step that takes the global batch; EPL cuts it);
`iterator` (a tf.function step that draws from a tf.data iterator; each unit draws
its own batch of the script's size).
"""
from __future__ import annotations

import argparse
import os
import warnings

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # Keras 3

from epl.runtime.cluster import use_virtual_cpus   # noqa: E402  (before TensorFlow runs an op)

use_virtual_cpus(4)

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402
import keras   # noqa: E402

import epl   # noqa: E402
from epl import env   # noqa: E402
from epl.runtime import eager_state   # noqa: E402

import tf2_models as models   # noqa: E402
from epl.hooks import function as function_hooks   # noqa: E402
from epl.passes.split.rewriter import SplitUnshardedVariableWarning   # noqa: E402
from epl.ir.annotations import SHARD_ATTR   # noqa: E402

# (op type, shard slot, device) of every split op of the rewritten traces
SPLIT_OPS: set = set()
# the SplitUnshardedVariableWarning messages of the last case
UNSHARDED: list = []
_REWRITE = function_hooks.rewrite


def _observed_rewrite(func_graph, state):
    """The trace rewrite, noting the split ops of the function it builds."""
    _REWRITE(func_graph, state)
    for op in func_graph.get_operations():
        if SHARD_ATTR in op.node_def.attr:
            SPLIT_OPS.add((op.type, op.get_attr(SHARD_ATTR), op.device))


function_hooks.rewrite = _observed_rewrite

STEPS = 3
UNIT_ROWS = 4   # the script's batch in iterator mode: one unit's
# name -> (config, pipeline stages, replicas R, micro-batches M, optimizer)
STRATEGIES = {
    "dp": ({"cluster.virtual_devices": 4}, False, 4, 1, "adam"),
    "ga": ({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}, False, 2, 2, "adam"),
    "pipeline": ({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2}, True, 2, 2,
                 "adam"),
    "gpipe": ({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
               "pipeline.strategy": "PreferForward"}, True, 1, 2, "adam"),
    "auto_stages": ({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
                     "auto.auto_parallel": True, "pipeline.num_stages": 2}, False, 1, 2, "adam"),
    "gc": ({"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto"}, False, 2, 1,
           "adam"),
    # a fixed loss scale: a dynamic one skips the steps whose float16 gradients overflow
    "amp": ({"cluster.virtual_devices": 2, "amp.level": "O1", "amp.loss_scale": 256.0}, False,
            2, 1, "adam"),
    "zero": ({"cluster.virtual_devices": 2, "zero.level": "v1"}, False, 2, 1, "v1_adam"),
    # a Keras 3 optimizer: its update region (element-wise ops after one IdentityN) sharded
    "zero_keras": ({"cluster.virtual_devices": 2, "zero.level": "v1"}, False, 2, 1, "adam"),
    # the classifier under epl.split(2), the rest data-parallel on the same 2 devices
    "split": ({"cluster.virtual_devices": 2}, False, 2, 1, "adam"),
    # the transformer's embeddings under a second epl.split(2) too (their lookups run
    # unsplit in a traced step, each table reported kept whole)
    "split_embedding": ({"cluster.virtual_devices": 2}, False, 2, 1, "adam"),
}
SPLIT_KINDS = {"split": True, "split_embedding": "embedding"}


def step_batches(x, y, units: int) -> list:
    """[[(x, y) of each unit] per step]: unit u of step i takes rows
    [(i U + u) b, (i U + u + 1) b) (b = UNIT_ROWS)."""
    out = []
    for i in range(STEPS):
        out.append([(x[(i * units + u) * UNIT_ROWS:(i * units + u + 1) * UNIT_ROWS],
                     y[(i * units + u) * UNIT_ROWS:(i * units + u + 1) * UNIT_ROWS])
                    for u in range(units)])
    return out


def run_epl(name: str, mode: str, strategy: str, initial, x, y) -> tuple:
    """(running mean losses, variables after training, rewritten traces, the names of
    the variables EPL created) of one case."""
    config, stages, replicas, micro, opt_name = STRATEGIES[strategy]
    env.reset()
    epl.init(epl.Config({"debug.check_invariants": True,
                         "communication.collective_timeout_s": 60, **config}))
    before = eager_state.StepState.created
    eager_state.StepState.names = []
    SPLIT_OPS.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SplitUnshardedVariableWarning)
        model = models.MODELS[name](use_epl=True, stages=stages,
                                    split=SPLIT_KINDS.get(strategy, False))
        model.set_weights(initial)
        opt = models.optimizer(opt_name)
        units = replicas * micro
        if mode == "fit":
            losses = _fit(model, opt, x, y, units * UNIT_ROWS)
        else:
            losses = _loop(model, opt, x, y, units, mode)
    UNSHARDED[:] = sorted({str(w.message) for w in caught
                           if issubclass(w.category, SplitUnshardedVariableWarning)})
    rewrites = eager_state.StepState.created - before
    env.reset()
    split_ops = sorted(f"{kind} {slot} {device}" for kind, slot, device in SPLIT_OPS)
    return losses, models.weights(model), rewrites, list(eager_state.StepState.names), split_ops


def _fit(model, opt, x, y, batch: int) -> list:
    model.compile(optimizer=opt, loss=models.loss_fn())
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(float(logs["loss"])))
    dataset = tf.data.Dataset.from_tensor_slices((x[:STEPS * batch], y[:STEPS * batch])).batch(batch)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[record])
    return seen


def _loop(model, opt, x, y, units: int, mode: str) -> list:
    lossf = models.loss_fn()
    trainable = model.trainable_variables
    if isinstance(opt, keras.optimizers.Optimizer):
        opt.build(trainable)

    def train(x_batch, y_batch):
        with tf.GradientTape() as tape:
            loss = lossf(y_batch, model(x_batch, training=True))
        grads = tape.gradient(loss, trainable)
        if isinstance(opt, keras.optimizers.Optimizer):
            opt.apply(grads, trainable)
        else:
            opt.apply_gradients(zip(grads, [v.value for v in trainable]))
        return loss

    if mode == "tensors":
        step = tf.function(train)
        batch = units * UNIT_ROWS
        calls = [lambda i=i: step(tf.constant(x[i * batch:(i + 1) * batch]),
                                  tf.constant(y[i * batch:(i + 1) * batch])) for i in range(STEPS)]
    else:
        iterator = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(UNIT_ROWS))

        @tf.function
        def step(it):
            x_batch, y_batch = next(it)
            return train(x_batch, y_batch)
        calls = [lambda: step(iterator)] * STEPS
    means, total = [], 0.0
    for i, call in enumerate(calls):
        total += float(call())
        means.append(total / (i + 1))   # every step has the same rows
    return means


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="model:mode:strategy,...")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    rows = STEPS * max(STRATEGIES[s][2] * STRATEGIES[s][3] for _, _, s in cases) * UNIT_ROWS
    record = {}
    for name, mode, strategy in cases:
        x, y = models.data(name, rows)
        initial = models.MODELS[name]().get_weights()
        _, _, replicas, micro, opt_name = STRATEGIES[strategy]
        case = f"{name}:{mode}:{strategy}"
        print(f"case {case}", flush=True)
        losses, values, rewrites, state, split_ops = run_epl(name, mode, strategy, initial, x, y)
        record[f"{case}/split_ops"] = np.array(split_ops)
        record[f"{case}/unsharded"] = np.array(UNSHARDED, dtype=str)
        record[f"{case}/losses"] = np.array(losses)
        record[f"{case}/rewrites"] = np.array(rewrites)
        record[f"{case}/state"] = np.array(state)
        record.update({f"{case}/var_{i}": v for i, v in enumerate(values)})
        key = f"{name}/ref_{replicas}x{micro}_{opt_name}"
        record[f"{case}/reference"] = np.array(key)
        for reverse in (False, True):
            ref = key + ("/reversed" if reverse else "")
            if f"{ref}/losses" in record:
                continue
            model = models.MODELS[name]()
            model.set_weights(initial)
            losses = models.reference_training(model, models.optimizer(opt_name),
                                               step_batches(x, y, replicas * micro),
                                               replicas, micro, reverse)
            record[f"{ref}/losses"] = np.array(losses)
            record.update({f"{ref}/var_{i}": v for i, v in enumerate(models.weights(model))})
    np.savez(args.out, **record)


if __name__ == "__main__":
    main()
