"""Step time of Keras 3 `model.fit` under EPL against tf.distribute.MirroredStrategy.

Both sides train the same Keras 3 model (an MLP of 4 x 512 ReLU layers, 64
features, 10 classes, Adam) with `model.fit` on the same tf.data dataset of global
batches, data-parallel over the same 2 virtual CPU devices of one process:

- epl: the model built under `epl.replicate(device_count=1)` after
  `epl.init({"cluster.virtual_devices": 2})`; fit's traced train step is rewritten
  by EPL (2 replicas, checked; each gets half of every batch).
- mirrored: the model built and compiled in `tf.distribute.MirroredStrategy`'s
  scope over the same two devices; fit distributes each batch over the replicas.

Keras 3 runs without TF_USE_LEGACY_KERAS (this script removes it). Both models
are traced first (one warm-up fit each), then the two sides alternate: each
repetition fits `--steps` steps of one side, then of the other, so both see the
same load on a shared machine. A side's step time in a repetition is the median
of the intervals between its consecutive batch ends; the ratio is the median over
repetitions of EPL's step time over MirroredStrategy's in the same repetition
(paired, so that load drift between repetitions cancels).

    python bench/keras_dp.py            # 8 repetitions x 20 steps, global batch 512
    python bench/keras_dp.py --quick    # a small MLP, few steps (smoke test)

Last line: `keras_dp: EPL/MirroredStrategy Keras fit step time ratio = X.XX (target <= 1.0)`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # Keras 3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from epl.runtime.cluster import use_virtual_cpus   # noqa: E402

use_virtual_cpus(2)   # before TensorFlow's first op: both sides' two devices

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402

import epl   # noqa: E402
from epl import env   # noqa: E402
from epl.runtime import eager_state   # noqa: E402

from common import median   # noqa: E402

FEATURES, CLASSES = 64, 10


def build(keras, width: int, depth: int):
    """The MLP, compiled with Adam."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((FEATURES,))] + [keras.layers.Dense(width, activation="relu")
                                           for _ in range(depth)] + [keras.layers.Dense(CLASSES)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def dataset(batch: int, steps: int) -> tf.data.Dataset:
    """`steps` global batches of synthetic data."""
    rng = np.random.RandomState(0)
    x = rng.randn(batch * steps, FEATURES).astype(np.float32)
    y = rng.randint(0, CLASSES, batch * steps).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


class StepTimes:
    """The intervals between consecutive batch ends of one fit (a Keras callback)."""

    def __init__(self, keras):
        self.ends: list[float] = []
        self.callback = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: self.ends.append(time.perf_counter()))

    def median_step(self) -> float:
        """Median seconds per step, the first interval (after the fit's start) left out."""
        return median(list(np.diff(self.ends)))


def timed_fit(keras, model, data) -> float:
    """Median step time of one fit over `data`."""
    times = StepTimes(keras)
    model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[times.callback])
    return times.median_step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=512, help="the global batch")
    parser.add_argument("--quick", action="store_true", help="small MLP, 3 x 6 steps")
    args = parser.parse_args()
    width, depth = (512, 4) if not args.quick else (64, 2)
    if args.quick:
        args.reps, args.steps, args.batch = 3, 6, 64

    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    import keras
    with epl.replicate(device_count=1):
        epl_model = build(keras, width, depth)
    data = dataset(args.batch, args.steps)
    before = eager_state.StepState.created
    epl_model.fit(data.take(2), epochs=1, verbose=0)   # traced and rewritten under EPL
    if eager_state.StepState.created == before:
        raise SystemExit("keras_dp: EPL did not rewrite the train step")
    env.reset()   # the MirroredStrategy side is traced without EPL

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        mirrored_model = build(keras, width, depth)
    mirrored_model.fit(data.take(2), epochs=1, verbose=0)

    ratios, epl_times, mirrored_times = [], [], []
    for _ in range(args.reps):
        epl_times.append(timed_fit(keras, epl_model, data))
        mirrored_times.append(timed_fit(keras, mirrored_model, data))
        ratios.append(epl_times[-1] / mirrored_times[-1])
    print(f"model: MLP {depth} x {width}, global batch {args.batch}, 2 replicas, "
          f"{args.reps} repetitions x {args.steps} steps")
    print(f"epl      median step {median(epl_times) * 1e3:.2f} ms")
    print(f"mirrored median step {median(mirrored_times) * 1e3:.2f} ms")
    print(f"ratio of the medians {median(epl_times) / median(mirrored_times):.2f}; per "
          f"repetition {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"keras_dp: EPL/MirroredStrategy Keras fit step time ratio = {median(ratios):.2f} "
          "(target <= 1.0)")


if __name__ == "__main__":
    main()
