"""A TensorFlow 2 custom training loop under EPL: a tf.function step, a split classifier.

An ordinary eager TensorFlow 2 program, as the Keras guide "Writing a training
loop from scratch" writes one: a Keras 3 model, a Keras optimizer, a
`@tf.function` step with `tf.GradientTape` and `optimizer.apply`, the batches
drawn from a tf.data iterator inside the step, and a `tf.train.CheckpointManager`.
The only EPL lines are `epl.init` and two scopes around the construction of the
layers: the feature extractor under `epl.replicate` (data parallelism: one
replica per device) and the wide classifier under `epl.split` (tensor
parallelism: its 1000 classes cut over the devices; the logits are never
gathered, the softmax cross-entropy is computed from the devices' parts).

The batch contract of a step that draws from an iterator: the script's batch
(`--batch`) is one replica's micro-batch, and each call of the step draws
replicas x micro-batches of them, so one call trains on that many batches (the
printed loss is the mean over all of them). In an eager program the split
classifier's weights stay the model's own variables (the split devices read
slices of them; docs/tf2.md), and the checkpoint holds them under their
single-device names: the script loads it into the same model built without EPL
and checks the values.

    python examples/tf2_custom_loop.py [--steps 40] [--batch 32] [--devices 4] [--ckpt DIR]
"""
import argparse
import os
import tempfile
import time

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # Keras 3 (make run exports it for tf-keras)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (parsed before TensorFlow is imported: --help answers at once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="one micro-batch of one pipeline")
    parser.add_argument("--devices", type=int, default=4, help="virtual CPU devices (CPU only)")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--ckpt", help="checkpoint directory (default: a temporary one)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()   # --help and bad options answer here, before TensorFlow is imported

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402

import epl   # noqa: E402

FEATURES, HIDDEN, CLASSES = 32, 256, 1000


def synthetic_dataset(batch: int, seed: int = 0) -> tf.data.Dataset:
    """An endless stream of (features, label) batches with a learnable signal."""
    rng = np.random.RandomState(seed)
    prototypes = rng.randn(CLASSES, FEATURES).astype(np.float32)
    labels = rng.randint(0, CLASSES, 20000).astype(np.int64)
    features = prototypes[labels] + 0.5 * rng.randn(20000, FEATURES).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((features, labels))
    return data.shuffle(20000, seed=seed).repeat().batch(batch, drop_remainder=True)


def build_model(keras, use_epl: bool, devices: int = 1):
    """Feature extractor (data-parallel) and classifier (split over `devices`) under
    their scopes when `use_epl`."""
    keras.utils.set_random_seed(0)
    with epl.replicate(device_count=1, name="features") if use_epl else _nothing():
        body = [keras.layers.Dense(HIDDEN, activation="relu"),
                keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.LayerNormalization()]
    with epl.split(device_count=devices, name="classifier") if use_epl else _nothing():
        head = keras.layers.Dense(CLASSES)
    return keras.Sequential([keras.Input((FEATURES,))] + body + [head])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> None:
    args = parse_args(argv)

    epl.init(epl.Config({"debug.log_level": "INFO", "cluster.virtual_devices": args.devices,
                         "pipeline.num_micro_batch": args.micro_batches}))
    import keras
    devices = epl.Env.get().cluster.gpu_num_per_worker
    units = devices * args.micro_batches
    print(f"tf2_custom_loop: {args.steps} steps, each {units} batches of {args.batch} "
          f"({devices} replica(s) x {args.micro_batches} micro-batches; the classifier split "
          f"over {devices} devices)", flush=True)

    model = build_model(keras, use_epl=True, devices=devices)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)   # its slots exist before the first call
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    iterator = iter(synthetic_dataset(args.batch))

    @tf.function
    def train_step(iterator):
        x, y = next(iterator)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    directory = args.ckpt or tempfile.mkdtemp(prefix="tf2_custom_loop_")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    start = time.perf_counter()
    first = None
    for step in range(1, args.steps + 1):
        loss = float(train_step(iterator))
        if step == 1:
            first = time.perf_counter()
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:5d}  loss {loss:.4f}", flush=True)
    end = time.perf_counter()
    path = manager.save()
    rate = (args.steps - 1) * units * args.batch / max(end - first, 1e-9)
    print(f"done: {args.steps} steps in {end - start:.1f} s (first step {first - start:.1f} s "
          f"with the trace and EPL's rewrite, then {rate:.0f} samples/s); final loss {loss:.4f}; "
          f"checkpoint {path}")

    # the checkpoint holds single-device variables: a model built without EPL loads it
    plain = build_model(keras, use_epl=False)
    tf.train.Checkpoint(model=plain).restore(path).expect_partial()
    same = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(model.weights, plain.weights))
    print(f"restored into a single-device model: {'same values' if same else 'DIFFERENT'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
