"""Checkpoints of eager TensorFlow 2 programs across layouts, in a Keras 3 process.

    python tests/workers/tf2_checkpoint_worker.py DIR

Prints one `OK <check>` line per check (and raises on the first that fails):
- saved under EPL, loaded single-device: after EPL training (a pipeline of 2 stages
  x 2 micro-batches over 2 pipelines), `model.save_weights` (.weights.h5), a
  `.keras` file, and `tf.train.Checkpoint` / `CheckpointManager` (model and
  optimizer) each load into a model built without EPL with the same values;
- saved single-device, loaded under EPL: a single-device checkpoint restored into a
  model EPL already trains (its replicas' copies must take the restored values),
  then trained on, equals single-device training continued from the same
  checkpoint; so does `load_weights` of a .weights.h5 file.
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # Keras 3

from epl.runtime.cluster import use_virtual_cpus   # noqa: E402

use_virtual_cpus(4)

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402
import keras   # noqa: E402

import epl   # noqa: E402
from epl import env   # noqa: E402

import tf2_models as models   # noqa: E402

CONFIG = {"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2,
          "communication.collective_timeout_s": 60}
BATCH = 16


def compiled(use_epl: bool):
    model = models.convnet(use_epl=use_epl, stages=use_epl)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=models.loss_fn())
    return model


def data(steps: int, seed: int):
    x, y = models.data("convnet", steps * BATCH, seed)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def same(a, b, what: str, exact: bool = True) -> None:
    for i, (u, v) in enumerate(zip(a.weights, b.weights)):
        if exact:
            np.testing.assert_array_equal(u.numpy(), v.numpy(), err_msg=f"{what}: {u.path}")
        else:
            np.testing.assert_allclose(u.numpy(), v.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{what}: {u.path}")
    print(f"OK {what}", flush=True)


def saved_under_epl_loads_single_device(directory: str) -> None:
    epl.init(epl.Config(CONFIG))
    model = compiled(True)
    model.fit(data(2, 0), epochs=1, verbose=0, shuffle=False)
    weights = os.path.join(directory, "epl.weights.h5")
    whole = os.path.join(directory, "epl.keras")
    model.save_weights(weights)
    model.save(whole)
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer),
        os.path.join(directory, "epl_ckpt"), max_to_keep=1)
    path = manager.save()
    env.reset()
    plain = compiled(False)
    plain.load_weights(weights)
    same(model, plain, "save_weights under EPL -> load_weights single-device")
    loaded = keras.models.load_model(whole)
    same(model, loaded, ".keras file under EPL -> load_model single-device")
    plain = compiled(False)
    plain.optimizer.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).restore(path).assert_consumed()
    same(model, plain, "tf.train.CheckpointManager under EPL -> restore single-device")


def saved_single_device_loads_under_epl(directory: str) -> None:
    env.reset()
    source = compiled(False)
    source.fit(data(2, 1), epochs=1, verbose=0, shuffle=False)
    path = tf.train.Checkpoint(model=source, optimizer=source.optimizer).write(
        os.path.join(directory, "plain_ckpt"))
    weights = os.path.join(directory, "plain.weights.h5")
    source.save_weights(weights)
    # the reference: single-device training continued from the checkpoint
    reference = compiled(False)
    reference.optimizer.build(reference.trainable_variables)
    tf.train.Checkpoint(model=reference, optimizer=reference.optimizer).read(path)

    epl.init(epl.Config(CONFIG))
    model = compiled(True)
    model.fit(data(1, 2), epochs=1, verbose=0, shuffle=False)   # EPL's copies exist now
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path)
    _same_seeds(model, reference)
    env.reset()   # the reference trains single-device
    continued = _continue(reference, micro_batched=True)
    epl.init(epl.Config(CONFIG))
    _continue(model)
    same(model, continued, "single-device checkpoint -> restore under EPL, trained on",
         exact=False)
    model = compiled(True)
    model.fit(data(1, 2), epochs=1, verbose=0, shuffle=False)
    model.load_weights(weights)   # the weights only: the optimizer's moments stay EPL's
    optimizer = [v.numpy() for v in model.optimizer.variables]
    env.reset()
    reference = compiled(False)
    reference.load_weights(weights)
    reference.optimizer.build(reference.trainable_variables)
    for v, value in zip(reference.optimizer.variables, optimizer):
        v.assign(value)
    _same_seeds(model, reference)
    epl.init(epl.Config(CONFIG))
    _continue(model)
    env.reset()
    same(model, _continue(reference, micro_batched=True),
         "single-device save_weights -> load_weights under EPL, trained on", exact=False)


def _same_seeds(source, target) -> None:
    """Give `target` the dropout-seed state of `source` (Keras keeps it in a variable of
    its own, which model checkpoints leave out)."""
    held = {id(v) for v in source.weights}
    seeds = [v for v in source.non_trainable_variables if id(v) not in held]
    held = {id(v) for v in target.weights}
    for v, w in zip(seeds, [v for v in target.non_trainable_variables if id(v) not in held]):
        w.assign(v.numpy())


def _continue(model, micro_batched: bool = False):
    """Two more steps on fixed data; the single-device side trains on each step's
    units (2 pipelines x 2 micro-batches of the batch) as EPL's step does."""
    if not micro_batched:
        model.fit(data(2, 3), epochs=1, verbose=0, shuffle=False)
        return model
    x, y = models.data("convnet", 2 * BATCH, 3)
    rows = BATCH // 4
    batches = [[(x[i * BATCH + u * rows:i * BATCH + (u + 1) * rows],
                 y[i * BATCH + u * rows:i * BATCH + (u + 1) * rows]) for u in range(4)]
               for i in range(2)]
    models.reference_training(model, model.optimizer, batches, replicas=2, micro=2)
    return model


def main() -> None:
    directory = sys.argv[1]
    saved_under_epl_loads_single_device(directory)
    saved_single_device_loads_under_epl(directory)


if __name__ == "__main__":
    main()
