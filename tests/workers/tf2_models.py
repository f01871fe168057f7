"""Keras 3 models written the way the Keras examples write them, their data, and the
single-device reference the TensorFlow 2 oracle compares EPL with.

Imported by the eager worker scripts (tests/workers/tf2_worker.py and others), which run in their own
processes without TF_USE_LEGACY_KERAS (Keras 3), after EPL created the virtual devices.

Models (tiny, for speed; `stages=True` builds each in two pipeline stages,
`split=True` builds its classifier under epl.split; the transformer's
`split="embedding"` builds its embeddings under a second epl.split too):
- `convnet`: Conv2D, BatchNormalization, ReLU, MaxPooling2D, Dropout, Dense
  (keras.io "Simple MNIST convnet", with batch norm);
- `transformer`: token and position embeddings, a transformer block with
  MultiHeadAttention, global average pooling, Dropout, Dense (keras.io "Text
  classification with Transformer");
- `custom`: a subclassed keras.Model that overrides train_step (keras.io
  "Customizing what happens in fit()").

The reference (`reference_training`): single-device training on the batches the
units consumed. One step takes the units' batches in unit order (replica-major);
each replica's micro-batches run one after the other from the state (dropout
seeds) the step started with, as EPL's replicas do (each holds its own copy;
replica 0's is the user's, so the state after the step is the one replica 0
leaves). Batch norm's moving averages follow graph mode's rule
(`batch_norm.moving_statistics: "replica0"`, the default): one update per step,
from the first unit's batch. The loss of the step is the mean of the units' losses
weighted by their rows, and one optimizer step applies its gradient. `reverse=True` takes the
gradient of each unit's weighted loss on its own and adds them in the other order:
the same function with another rounding (as EPL adds the units' gradients), the
noise floor the oracle's tolerance comes from (Adam amplifies it where a gradient is
near zero, e.g. a convolution's bias before batch normalization).
"""
from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf
import keras
from keras import layers

import epl

NUM_CLASSES = 6   # divisible by 2: the split cases shard the classifier evenly
IMAGE = (8, 8, 1)
VOCAB, MAXLEN, EMBED, HEADS, FF = 40, 6, 8, 2, 16
FEATURES = 6


def scope(use_epl: bool, kind: str = "replicate", name: str | None = None):
    """An EPL scope when `use_epl`, else nothing."""
    if not use_epl:
        return contextlib.nullcontext()
    return (epl.split if kind == "split" else epl.replicate)(1 if kind != "split" else 2, name=name)


def convnet(use_epl: bool = False, stages: bool = False, split: bool = False) -> keras.Model:
    """A small convnet with batch norm and dropout (functional API)."""
    keras.utils.set_random_seed(1)
    with scope(use_epl and stages, name="stage_0"):
        inputs = keras.Input(shape=IMAGE)
        conv = layers.Conv2D(4, kernel_size=(3, 3), padding="same", use_bias=False)
        norm = layers.BatchNormalization()
        relu = layers.ReLU()
        pool = layers.MaxPooling2D(pool_size=(2, 2))
    with scope(use_epl and stages, name="stage_1"):
        drop = layers.Dropout(0.25)
        flat = layers.Flatten()
    with scope(use_epl and split, "split", name="classifier"):
        head = layers.Dense(NUM_CLASSES)
    x = pool(relu(norm(conv(inputs))))
    outputs = head(flat(drop(x)))
    return keras.Model(inputs, outputs, name="convnet")


class TokenAndPositionEmbedding(layers.Layer):
    """Token embedding plus a learned position embedding (keras.io)."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = tf.shape(x)[-1]
        positions = tf.range(start=0, limit=maxlen, delta=1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(layers.Layer):
    """Self-attention and a feed-forward network, each with a residual and layer norm."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


def transformer(use_epl: bool = False, stages: bool = False, split: bool | str = False
                ) -> keras.Model:
    """A text classifier: embeddings, one transformer block, pooling, a dense head."""
    keras.utils.set_random_seed(2)
    with scope(use_epl and stages, name="stage_0"):
        inputs = layers.Input(shape=(MAXLEN,), dtype="int32")
        with scope(use_epl and split == "embedding", "split", name="embedding"):
            embedding = TokenAndPositionEmbedding(MAXLEN, VOCAB, EMBED)
        block = TransformerBlock(EMBED, HEADS, FF)
    with scope(use_epl and stages, name="stage_1"):
        pool = layers.GlobalAveragePooling1D()
        drop = layers.Dropout(0.1)
    with scope(use_epl and split, "split", name="classifier"):
        head = layers.Dense(NUM_CLASSES)
    x = block(embedding(inputs))
    outputs = head(drop(pool(x)))
    return keras.Model(inputs=inputs, outputs=outputs, name="transformer")


class CustomModel(keras.Model):
    """A subclassed model whose train_step is its own (keras.io, Keras 3, TensorFlow)."""

    def __init__(self, use_epl: bool = False, stages: bool = False, split: bool = False):
        super().__init__()
        # split: the layers before the split classifier under epl.replicate, as EPL's
        # split examples scope a data-parallel body (the other models leave it unscoped)
        with scope(use_epl and split and not stages, name="body"):
            with scope(use_epl and stages, name="stage_0"):
                self.hidden = layers.Dense(16, activation="relu")
            with scope(use_epl and stages, name="stage_1"):
                self.norm = layers.LayerNormalization()
        with scope(use_epl and split, "split", name="classifier"):
            self.out = layers.Dense(NUM_CLASSES)

    def call(self, x):
        return self.out(self.norm(self.hidden(x)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom(use_epl: bool = False, stages: bool = False, split: bool = False) -> keras.Model:
    """The subclassed model, built."""
    keras.utils.set_random_seed(3)
    model = CustomModel(use_epl, stages, split)
    model(np.zeros((1, FEATURES), np.float32))   # builds its layers
    return model


MODELS = {"convnet": convnet, "transformer": transformer, "custom": custom}


def data(model: str, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, integer labels) of `rows` examples for `model`."""
    rng = np.random.RandomState(100 + seed)
    if model == "convnet":
        x = rng.randn(rows, *IMAGE).astype(np.float32)
    elif model == "transformer":
        x = rng.randint(0, VOCAB, (rows, MAXLEN)).astype(np.int32)
    else:
        x = rng.randn(rows, FEATURES).astype(np.float32)
    return x, rng.randint(0, NUM_CLASSES, rows).astype(np.int64)


def loss_fn():
    """The loss every run compiles with."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer(name: str = "adam"):
    """A fresh optimizer: Keras 3 Adam, or the tf.compat.v1 Adam that ZeRO shards."""
    if name == "v1_adam":
        return tf.compat.v1.train.AdamOptimizer(0.01)
    return keras.optimizers.Adam(0.01)


def reference_training(model: keras.Model, opt, batches: list, replicas: int, micro: int,
                       reverse: bool = False) -> list[float]:
    """Train `model` single-device on `batches` ([(x, y) per unit] per step); returns the
    running mean of the loss after each step (what Keras fit logs)."""
    lossf = loss_fn()
    trainable = model.trainable_variables
    state = [v for v in model.non_trainable_variables]
    moving = [i for i, v in enumerate(state)
              if v.path.endswith(("moving_mean", "moving_variance"))]
    if isinstance(opt, keras.optimizers.Optimizer) and not opt.built:
        opt.build(trainable)

    @tf.function
    def step(xs, ys):
        units = [(xs[u], ys[u]) for u in range(replicas * micro)]
        start = [tf.convert_to_tensor(v) for v in state]
        with tf.GradientTape(persistent=reverse) as tape:
            losses, rows, after_first = [], [], None
            for k in range(replicas):
                for v, s in zip(state, start):
                    v.assign(s)
                for m in range(micro):
                    x, y = units[k * micro + m]
                    losses.append(lossf(y, model(x, training=True)))
                    rows.append(tf.cast(tf.shape(x)[0], tf.float32))
                    if k == 0 and m == 0:
                        after_unit0 = [tf.convert_to_tensor(v) for v in state]
                if k == 0:
                    after_first = [tf.convert_to_tensor(v) for v in state]
                    for i in moving:   # graph mode's moving statistics: the first unit's
                        after_first[i] = after_unit0[i]
            total_rows = tf.add_n(rows)
            terms = [loss * n / total_rows for loss, n in zip(losses, rows)]
            total = tf.add_n(terms)
        for v, a in zip(state, after_first):
            v.assign(a)
        if reverse:
            per_unit = [tape.gradient(term, trainable) for term in terms[::-1]]
            grads = [tf.add_n(list(g)) for g in zip(*per_unit)]
        else:
            grads = tape.gradient(total, trainable)
        if isinstance(opt, keras.optimizers.Optimizer):
            opt.apply(grads, trainable)
        else:
            opt.apply_gradients(zip(grads, [getattr(v, "value", v) for v in trainable]))
        return total * total_rows, total_rows

    means, loss_sum, row_sum = [], 0.0, 0.0
    for units in batches:
        weighted, rows = step(tf.constant(np.stack([x for x, _ in units])),
                              tf.constant(np.stack([y for _, y in units])))
        loss_sum, row_sum = loss_sum + float(weighted), row_sum + float(rows)
        means.append(loss_sum / row_sum)
    return means


def weights(model: keras.Model) -> list[np.ndarray]:
    """Every variable of the model (trainable and state), in order."""
    return [v.numpy() for v in model.variables]
