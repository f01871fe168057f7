"""Train a Keras 3 text classifier with `model.fit`, data plus pipeline parallelism.

An ordinary Keras 3 program (eager TensorFlow 2, no TF_USE_LEGACY_KERAS): the
layers of a transformer text classifier (keras.io "Text classification with
Transformer") built in two groups, compiled and fit on a tf.data dataset. The only
EPL lines are `epl.init` and the two `epl.replicate` scopes around the layers'
construction: each group is a pipeline stage (each layer re-enters its scope when
fit traces the train step), `pipeline.num_micro_batch` micro-batches flow through
the stages per step, and with 4 devices there are two pipelines (data parallelism
over pipelines). fit's `batch_size` is the global batch, as with
tf.distribute: EPL cuts it into pipelines x micro-batches.

The data are synthetic with a learnable signal: each class prefers its own band of
token ids, so the loss falls well below log(classes).

    python examples/keras_fit.py [--steps 60] [--batch 64] [--devices 4] [--micro-batches 4]

Output: a first line at once, EPL's summary of the rewritten train step (logged at
INFO when fit first traces it), Keras's progress (loss), and an end line with the
loss of the last epoch and samples/s after the first epoch (the trace and rewrite).
"""
import argparse
import os
import time

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # Keras 3 (make run exports it for tf-keras)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (parsed before TensorFlow is imported: --help answers at once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps in all (over the epochs)")
    parser.add_argument("--batch", type=int, default=64,
                        help="the global batch of each step (fit's batch_size)")
    parser.add_argument("--devices", type=int, default=4, help="virtual CPU devices (CPU only)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()   # --help and bad options answer here, before TensorFlow is imported

import numpy as np   # noqa: E402
import tensorflow as tf   # noqa: E402

import epl   # noqa: E402

VOCAB, MAXLEN, EMBED, HEADS, FF, CLASSES = 2000, 32, 64, 4, 128, 4


def synthetic_data(rows: int, seed: int = 0):
    """(token ids [rows, MAXLEN], labels): class c draws most tokens from its band."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, CLASSES, rows)
    band = VOCAB // CLASSES
    own = labels[:, None] * band + rng.randint(0, band, (rows, MAXLEN))
    noise = rng.randint(0, VOCAB, (rows, MAXLEN))
    tokens = np.where(rng.rand(rows, MAXLEN) < 0.3, own, noise)
    return tokens.astype(np.int32), labels.astype(np.int64)


def build_layers(keras, layers):
    """The classifier's layers in two pipeline stages; returns the model."""

    class TokenAndPositionEmbedding(layers.Layer):
        """Token embedding plus a learned position embedding (keras.io)."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.token_emb = layers.Embedding(input_dim=VOCAB, output_dim=EMBED)
            self.pos_emb = layers.Embedding(input_dim=MAXLEN, output_dim=EMBED)

        def call(self, x):
            return self.token_emb(x) + self.pos_emb(tf.range(tf.shape(x)[-1]))

    with epl.replicate(device_count=1, name="stage_0"):
        inputs = keras.Input(shape=(MAXLEN,), dtype="int32")
        embedding = TokenAndPositionEmbedding()
        attention = layers.MultiHeadAttention(num_heads=HEADS, key_dim=EMBED // HEADS)
        norm1 = layers.LayerNormalization(epsilon=1e-6)
    with epl.replicate(device_count=1, name="stage_1"):
        ffn = keras.Sequential([layers.Dense(FF, activation="relu"), layers.Dense(EMBED)])
        norm2 = layers.LayerNormalization(epsilon=1e-6)
        pool = layers.GlobalAveragePooling1D()
        drop = layers.Dropout(0.1)
        head = layers.Dense(CLASSES)
    x = embedding(inputs)
    x = norm1(x + attention(x, x))
    x = norm2(x + ffn(x))
    return keras.Model(inputs, head(drop(pool(x))), name="text_classifier")


def main(argv=None) -> None:
    args = parse_args(argv)

    epl.init(epl.Config({"debug.log_level": "INFO", "cluster.virtual_devices": args.devices,
                         "pipeline.num_micro_batch": args.micro_batches}))
    import keras   # after epl.init: its devices exist before TensorFlow's first op
    from keras import layers
    pipelines = max(1, epl.Env.get().cluster.gpu_num_per_worker // 2)
    print(f"keras_fit: {args.steps} steps of {args.batch} examples ({pipelines} pipeline(s) "
          f"x 2 stages, {args.micro_batches} micro-batches); building the model", flush=True)

    keras.utils.set_random_seed(0)
    model = build_layers(keras, layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps_per_epoch = max(1, args.steps // args.epochs)
    tokens, labels = synthetic_data(steps_per_epoch * args.batch)
    dataset = tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(args.batch,
                                                                         drop_remainder=True)
    times = []
    timer = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: times.append(
        time.perf_counter()))
    start = time.perf_counter()
    history = model.fit(dataset, epochs=args.epochs, verbose=2, shuffle=False, callbacks=[timer])
    later = (args.epochs - 1) * steps_per_epoch * args.batch
    rate = f", then {later / (times[-1] - times[0]):.0f} samples/s" if args.epochs > 1 else ""
    print(f"done: {args.epochs * steps_per_epoch} steps in {times[-1] - start:.1f} s (first epoch "
          f"{times[0] - start:.1f} s, with the trace and EPL's rewrite{rate}); final loss "
          f"{history.history['loss'][-1]:.4f} (log({CLASSES}) = {np.log(CLASSES):.4f})")


if __name__ == "__main__":
    main()
