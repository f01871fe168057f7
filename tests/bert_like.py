"""A small BERT-like pre-training model written the way real TF1 code is.

Written from scratch in the style of Google BERT's `modeling.py` and
`run_pretraining.py`, for the tests: the input pipeline batches with
`drop_remainder=True` (static batch), `get_shape_list` returns Python ints
where shapes are static and every reshape is built from them (the batch size
is baked into the graph), dense layers are `tf.compat.v1.layers.dense` (legacy
Keras), with dropout and layer norm, and the masked-LM output layer is tied to
the input embedding table (`tf.matmul(x, table, transpose_b=True)`).

`build_pretraining(batch, ...)` builds the whole step in the current graph
and returns its handles. `stages` puts the embeddings and the first half of
the layers under `epl.replicate(1, "stage_0")` and the rest (and the heads)
under `stage_1`, as EPL's pipeline tutorial does.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import tensorflow as tf

import epl


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Sizes of the model (BERT's BertConfig, scaled down)."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 64
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 16
    type_vocab_size: int = 2
    initializer_range: float = 0.02


SEQ_LEN, MAX_PREDICTIONS = 16, 4


def get_shape_list(tensor: tf.Tensor) -> list:
    """The shape of `tensor`: Python ints for static dimensions, scalar tensors for the
    dynamic ones (BERT's helper)."""
    shape = tensor.shape.as_list()
    dynamic = tf.shape(tensor)
    return [dim if dim is not None else dynamic[i] for i, dim in enumerate(shape)]


def create_initializer(initializer_range: float):
    return tf.compat.v1.truncated_normal_initializer(stddev=initializer_range)


def layer_norm(input_tensor: tf.Tensor, name: str) -> tf.Tensor:
    """Layer normalization over the last axis, with its own gamma and beta."""
    with tf.compat.v1.variable_scope(name):
        width = input_tensor.shape[-1]
        gamma = tf.compat.v1.get_variable("gamma", [width], initializer=tf.ones_initializer())
        beta = tf.compat.v1.get_variable("beta", [width], initializer=tf.zeros_initializer())
        mean, variance = tf.nn.moments(input_tensor, axes=[-1], keepdims=True)
        return (input_tensor - mean) * tf.math.rsqrt(variance + 1e-12) * gamma + beta


def dropout(input_tensor: tf.Tensor, dropout_prob: float) -> tf.Tensor:
    if not dropout_prob:
        return input_tensor
    return tf.compat.v1.nn.dropout(input_tensor, rate=dropout_prob)


def embeddings(input_ids, token_type_ids, config: BertConfig):
    """(embedded input [batch, seq, hidden], the word embedding table)."""
    batch_size, seq_length = get_shape_list(input_ids)
    with tf.compat.v1.variable_scope("embeddings"):
        table = tf.compat.v1.get_variable(
            "word_embeddings", [config.vocab_size, config.hidden_size],
            initializer=create_initializer(config.initializer_range))
        flat_ids = tf.reshape(input_ids, [-1])
        output = tf.gather(table, flat_ids)
        output = tf.reshape(output, [batch_size, seq_length, config.hidden_size])
        token_table = tf.compat.v1.get_variable(
            "token_type_embeddings", [config.type_vocab_size, config.hidden_size],
            initializer=create_initializer(config.initializer_range))
        one_hot_ids = tf.one_hot(tf.reshape(token_type_ids, [-1]), depth=config.type_vocab_size)
        token_type = tf.matmul(one_hot_ids, token_table)
        output += tf.reshape(token_type, [batch_size, seq_length, config.hidden_size])
        position_table = tf.compat.v1.get_variable(
            "position_embeddings", [config.max_position_embeddings, config.hidden_size],
            initializer=create_initializer(config.initializer_range))
        positions = tf.slice(position_table, [0, 0], [seq_length, -1])
        output += tf.expand_dims(positions, 0)
        output = layer_norm(output, "LayerNorm")
        return dropout(output, config.hidden_dropout_prob), table


def attention_mask_from(input_mask, batch_size: int, seq_length: int) -> tf.Tensor:
    """[batch, seq, seq] mask: position j is visible where input_mask[j] is 1."""
    to_mask = tf.cast(tf.reshape(input_mask, [batch_size, 1, seq_length]), tf.float32)
    return tf.ones([batch_size, seq_length, 1], tf.float32) * to_mask


def attention_layer(tensor_2d, attention_mask, batch_size: int, seq_length: int,
                    config: BertConfig) -> tf.Tensor:
    """Multi-head self-attention on a [batch * seq, hidden] tensor."""
    heads = config.num_attention_heads
    size = config.hidden_size // heads

    def project(name):
        layer = tf.compat.v1.layers.dense(
            tensor_2d, heads * size, name=name,
            kernel_initializer=create_initializer(config.initializer_range))
        layer = tf.reshape(layer, [batch_size, seq_length, heads, size])
        return tf.transpose(layer, [0, 2, 1, 3])

    query, key, value = project("query"), project("key"), project("value")
    scores = tf.matmul(query, key, transpose_b=True) * (1.0 / np.sqrt(float(size)))
    adder = (1.0 - tf.expand_dims(attention_mask, axis=[1])) * -10000.0
    probs = dropout(tf.nn.softmax(scores + adder), config.attention_probs_dropout_prob)
    context = tf.transpose(tf.matmul(probs, value), [0, 2, 1, 3])
    return tf.reshape(context, [batch_size * seq_length, heads * size])


def transformer_layer(layer_input, attention_mask, batch_size: int, seq_length: int,
                      config: BertConfig, index: int) -> tf.Tensor:
    """One encoder layer on [batch * seq, hidden] (BERT keeps the 2-D form)."""
    init = create_initializer(config.initializer_range)
    with tf.compat.v1.variable_scope(f"layer_{index}"):
        with tf.compat.v1.variable_scope("attention"):
            with tf.compat.v1.variable_scope("self"):
                attended = attention_layer(layer_input, attention_mask, batch_size, seq_length,
                                           config)
            with tf.compat.v1.variable_scope("output"):
                attended = tf.compat.v1.layers.dense(attended, config.hidden_size,
                                                     kernel_initializer=init)
                attended = dropout(attended, config.hidden_dropout_prob)
                attended = layer_norm(attended + layer_input, "LayerNorm")
        with tf.compat.v1.variable_scope("intermediate"):
            intermediate = tf.compat.v1.layers.dense(attended, config.intermediate_size,
                                                     activation=tf.nn.gelu,
                                                     kernel_initializer=init)
        with tf.compat.v1.variable_scope("output"):
            output = tf.compat.v1.layers.dense(intermediate, config.hidden_size,
                                               kernel_initializer=init)
            output = dropout(output, config.hidden_dropout_prob)
            return layer_norm(output + attended, "LayerNorm")


def gather_indexes(sequence_tensor, positions) -> tf.Tensor:
    """The vectors at `positions` ([batch, P]) of a [batch, seq, width] tensor, as
    [batch * P, width] (BERT's flat-offset gather: the batch size is baked in)."""
    batch_size, seq_length, width = get_shape_list(sequence_tensor)
    flat_offsets = tf.reshape(tf.range(0, batch_size, dtype=tf.int32) * seq_length, [-1, 1])
    flat_positions = tf.reshape(positions + flat_offsets, [-1])
    flat_sequence = tf.reshape(sequence_tensor, [batch_size * seq_length, width])
    return tf.gather(flat_sequence, flat_positions)


def masked_lm_loss(sequence_output, table, positions, label_ids, label_weights,
                   config: BertConfig) -> tf.Tensor:
    """Masked-LM loss with the output layer tied to the input embedding table."""
    x = gather_indexes(sequence_output, positions)
    with tf.compat.v1.variable_scope("cls/predictions"):
        with tf.compat.v1.variable_scope("transform"):
            x = tf.compat.v1.layers.dense(
                x, config.hidden_size, activation=tf.nn.gelu,
                kernel_initializer=create_initializer(config.initializer_range))
            x = layer_norm(x, "LayerNorm")
        output_bias = tf.compat.v1.get_variable("output_bias", [config.vocab_size],
                                                initializer=tf.zeros_initializer())
        logits = tf.nn.bias_add(tf.matmul(x, table, transpose_b=True), output_bias)
        log_probs = tf.nn.log_softmax(logits, axis=-1)
        label_ids = tf.reshape(label_ids, [-1])
        label_weights = tf.reshape(label_weights, [-1])
        one_hot = tf.one_hot(label_ids, depth=config.vocab_size, dtype=tf.float32)
        per_example_loss = -tf.reduce_sum(log_probs * one_hot, axis=[-1])
        numerator = tf.reduce_sum(label_weights * per_example_loss)
        denominator = tf.reduce_sum(label_weights) + 1e-5
        return numerator / denominator


def next_sentence_loss(pooled, labels, config: BertConfig) -> tf.Tensor:
    with tf.compat.v1.variable_scope("cls/seq_relationship"):
        weights = tf.compat.v1.get_variable(
            "output_weights", [2, config.hidden_size],
            initializer=create_initializer(config.initializer_range))
        bias = tf.compat.v1.get_variable("output_bias", [2], initializer=tf.zeros_initializer())
        logits = tf.nn.bias_add(tf.matmul(pooled, weights, transpose_b=True), bias)
        log_probs = tf.nn.log_softmax(logits, axis=-1)
        one_hot = tf.one_hot(tf.reshape(labels, [-1]), depth=2, dtype=tf.float32)
        return tf.reduce_mean(-tf.reduce_sum(one_hot * log_probs, axis=-1))


def make_examples(count: int, seed: int = 0, config: BertConfig = BertConfig()) -> dict:
    """`count` synthetic pre-training examples (numpy), every masked position used
    (label weights all 1, so the masked-LM loss is a mean over predictions)."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(1, config.vocab_size, (count, SEQ_LEN)).astype(np.int32)
    mask = np.ones((count, SEQ_LEN), np.int32)
    mask[:, SEQ_LEN - 3:] = rng.randint(0, 2, (count, 3))
    positions = np.stack([rng.choice(SEQ_LEN - 3, MAX_PREDICTIONS, replace=False)
                          for _ in range(count)]).astype(np.int32)
    return {"input_ids": ids, "input_mask": mask,
            "segment_ids": (np.arange(SEQ_LEN)[None, :] >= SEQ_LEN // 2).astype(np.int32)
            .repeat(count, 0),
            "masked_lm_positions": positions,
            "masked_lm_ids": np.take_along_axis(ids, positions, 1),
            "masked_lm_weights": np.ones((count, MAX_PREDICTIONS), np.float32),
            "next_sentence_labels": rng.randint(0, 2, (count, 1)).astype(np.int32)}


def input_fn(examples: dict, batch_size: int) -> dict:
    """run_pretraining.py's input: repeat, then batch with drop_remainder=True."""
    dataset = tf.data.Dataset.from_tensor_slices(examples)
    dataset = dataset.repeat().batch(batch_size, drop_remainder=True)
    return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


@dataclasses.dataclass
class Pretraining:
    """Handles of a built pre-training step."""

    loss: tf.Tensor
    train_op: tf.Operation
    global_step: tf.Variable
    features: dict


def _stage(index: int | None):
    if index is None:
        return contextlib.nullcontext()
    return epl.replicate(device_count=1, name=f"stage_{index}")


def build_pretraining(batch_size: int, examples: dict, config: BertConfig = BertConfig(),
                      stages: bool = False, optimizer=None, seed: int = 1234,
                      checkpoint_layers: bool = False, chunks: int = 1) -> Pretraining:
    """The pre-training step on `examples` in batches of `batch_size`.

    stages: two pipeline stages (embeddings and the first half of the layers,
    then the rest and the heads); checkpoint_layers: add every layer's output
    to the "checkpoints" collection (gradient_checkpoint.type "collection");
    chunks: draw the batch as `chunks` batches of batch_size / chunks and
    average their losses (the same function in another summation order: the
    noise floor of the tests' tolerance).
    """
    tf.compat.v1.set_random_seed(seed)
    loss, features = _chunked_loss(batch_size, examples, config, stages, checkpoint_layers,
                                   chunks)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = optimizer or tf.compat.v1.train.AdamOptimizer(1e-3)
    train_op = optimizer.minimize(loss, global_step=global_step)
    return Pretraining(loss, train_op, global_step, features)


def _chunked_loss(batch_size, examples, config, stages, checkpoint_layers, chunks: int):
    """(loss, features) of one batch, or, with chunks > 1, the mean of the losses of
    `chunks` consecutive smaller batches (the same rows, another summation order)."""
    if chunks == 1:
        return _pretraining_loss(batch_size, examples, config, stages, checkpoint_layers)
    with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                     reuse=tf.compat.v1.AUTO_REUSE):
        next_batch = _chunk_iterator(examples, batch_size // chunks)
        parts = [_pretraining_loss(batch_size // chunks, examples, config, stages,
                                   checkpoint_layers, next_batch) for _ in range(chunks)]
    return tf.add_n([p[0] for p in parts]) / chunks, parts[0][1]


def _chunk_iterator(examples: dict, batch_size: int):
    iterator = tf.compat.v1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(examples).repeat().batch(batch_size,
                                                                    drop_remainder=True))
    previous = []

    def next_batch():  # draws in order: each waits for the one before it
        with tf.control_dependencies(previous[-1:]):
            features = iterator.get_next()
        previous.append(next(iter(features.values())))
        return features
    return next_batch


def _pretraining_loss(batch_size, examples, config, stages, checkpoint_layers,
                      next_batch=None):
    features = next_batch() if next_batch is not None else input_fn(examples, batch_size)
    input_ids = features["input_ids"]
    batch, seq_length = get_shape_list(input_ids)
    split_at = (config.num_hidden_layers + 1) // 2
    with _stage(0 if stages else None):
        embedded, table = embeddings(input_ids, features["segment_ids"], config)
        mask = attention_mask_from(features["input_mask"], batch, seq_length)
        hidden = tf.reshape(embedded, [batch * seq_length, config.hidden_size])
        for index in range(split_at):
            hidden = transformer_layer(hidden, mask, batch, seq_length, config, index)
            if checkpoint_layers:
                tf.compat.v1.add_to_collection("checkpoints", hidden)
    with _stage(1 if stages else None):
        for index in range(split_at, config.num_hidden_layers):
            hidden = transformer_layer(hidden, mask, batch, seq_length, config, index)
            if checkpoint_layers:
                tf.compat.v1.add_to_collection("checkpoints", hidden)
        sequence_output = tf.reshape(hidden, [batch, seq_length, config.hidden_size])
        first_token = tf.squeeze(sequence_output[:, 0:1, :], axis=1)
        pooled = tf.compat.v1.layers.dense(
            first_token, config.hidden_size, activation=tf.tanh, name="pooler",
            kernel_initializer=create_initializer(config.initializer_range))
        loss = masked_lm_loss(sequence_output, table, features["masked_lm_positions"],
                              features["masked_lm_ids"], features["masked_lm_weights"], config) \
            + next_sentence_loss(pooled, features["next_sentence_labels"], config)
    return loss, features


def load_initial_values(session, graph: tf.Graph, scale: float = 0.02) -> None:
    """Give every trainable variable a value drawn from its name (after the
    initializer ran), so that graphs that create their ops in another order (a
    chunked reference) start from the same weights. Layer-norm gammas start at 1.
    """
    import zlib
    for var in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
        name = var.op.name
        rng = np.random.RandomState(zlib.crc32(name.encode()))
        value = rng.randn(*var.shape.as_list()).astype(np.float32) * scale
        if name.endswith("gamma"):
            value += 1.0
        var.load(value, session)


# --------------------------------------------------------------------------
# BERT-style optimization: tf.gradients, global-norm clipping, and an optimizer
# whose apply_gradients is its own assign ops (optimization.py's pattern)
# --------------------------------------------------------------------------


class AdamWeightDecayOptimizer(tf.compat.v1.train.Optimizer):
    """Adam with decoupled weight decay, updating with plain assign ops (BERT's
    optimizer): its own slot variables, no bias correction, and an
    apply_gradients that never calls the base class."""

    def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-6, exclude_from_weight_decay=None, name="AdamWeightDecayOptimizer"):
        super().__init__(False, name)
        self.learning_rate = learning_rate
        self.weight_decay_rate = weight_decay_rate
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.exclude_from_weight_decay = exclude_from_weight_decay

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        assignments = []
        for grad, param in grads_and_vars:
            if grad is None or param is None:
                continue
            param_name = param.op.name
            m = tf.compat.v1.get_variable(param_name + "/adam_m", shape=param.shape.as_list(),
                                          dtype=tf.float32, trainable=False,
                                          initializer=tf.zeros_initializer())
            v = tf.compat.v1.get_variable(param_name + "/adam_v", shape=param.shape.as_list(),
                                          dtype=tf.float32, trainable=False,
                                          initializer=tf.zeros_initializer())
            next_m = tf.multiply(self.beta_1, m) + tf.multiply(1.0 - self.beta_1, grad)
            next_v = tf.multiply(self.beta_2, v) + tf.multiply(1.0 - self.beta_2, tf.square(grad))
            update = next_m / (tf.sqrt(next_v) + self.epsilon)
            if self._do_use_weight_decay(param_name):
                update += self.weight_decay_rate * param
            next_param = param - self.learning_rate * update
            assignments.extend([param.assign(next_param), m.assign(next_m), v.assign(next_v)])
        return tf.group(*assignments, name=name)

    def _do_use_weight_decay(self, param_name: str) -> bool:
        if not self.weight_decay_rate:
            return False
        import re
        return not any(re.search(pattern, param_name) for pattern in
                       self.exclude_from_weight_decay or [])


def create_optimizer(loss, init_lr: float, num_train_steps: int) -> tf.Operation:
    """The training op: polynomial decay of the learning rate, tf.gradients, clipping by
    global norm, the weight-decay Adam, and the global step incremented by hand."""
    global_step = tf.compat.v1.train.get_or_create_global_step()
    learning_rate = tf.compat.v1.train.polynomial_decay(
        tf.constant(init_lr, dtype=tf.float32), global_step, num_train_steps,
        end_learning_rate=0.0, power=1.0, cycle=False)
    optimizer = AdamWeightDecayOptimizer(
        learning_rate=learning_rate, weight_decay_rate=0.01,
        exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias", "beta", "gamma"])
    tvars = tf.compat.v1.trainable_variables()
    grads = tf.gradients(loss, tvars)
    grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
    train_op = optimizer.apply_gradients(zip(grads, tvars), global_step=global_step)
    new_global_step = global_step + 1
    return tf.group(train_op, [global_step.assign(new_global_step)])


def build_pretraining_custom(batch_size: int, examples: dict, config: BertConfig = BertConfig(),
                             stages: bool = False, checkpoint_layers: bool = False,
                             chunks: int = 1, init_lr: float = 1e-2) -> Pretraining:
    """`build_pretraining`'s model trained by `create_optimizer` (BERT's training step)."""
    tf.compat.v1.set_random_seed(1234)
    loss, features = _chunked_loss(batch_size, examples, config, stages, checkpoint_layers,
                                   chunks)
    train_op = create_optimizer(loss, init_lr, 100)
    return Pretraining(loss, train_op, tf.compat.v1.train.get_or_create_global_step(), features)


# --------------------------------------------------------------------------
# Training runs for the oracle tests
# --------------------------------------------------------------------------


def train(builder, batch_size: int, examples: dict, config: dict | None, steps: int = 3,
          chunks: int = 1, **build_kwargs):
    """(losses, {variable name: value} of every global variable EPL did not add,
    graph) after `steps` steps of `builder` (build_pretraining or
    build_pretraining_custom); under EPL when `config` is a dict."""
    from epl import env
    env.reset()
    if config is not None:
        epl.init(epl.Config({"debug.check_invariants": True, **config}))
    with tf.Graph().as_default() as graph:
        step = builder(batch_size, examples, chunks=chunks, **build_kwargs)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            load_initial_values(sess, graph)
            losses = [float(sess.run([step.train_op, step.loss])[1]) for _ in range(steps)]
            variables = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                         if not v.op.name.startswith("EPL_")]
            values = dict(zip([v.op.name for v in variables], sess.run(variables)))
    env.reset()
    return losses, values, graph


_REFERENCES: dict = {}


def reference(builder, batch_size: int, examples: dict, steps: int = 3):
    """Single-device training of `builder` on batches of `batch_size` and its noise
    floor: per variable (and "<losses>"), the largest difference against the same
    training with each batch drawn and summed in two halves (tests/conftest.py
    explains the tolerance). Cached."""
    key = (builder.__name__, batch_size, id(examples), steps)
    if key not in _REFERENCES:
        plain = train(builder, batch_size, examples, None, steps)
        halves = train(builder, batch_size, examples, None, steps, chunks=2)
        floor = {name: float(np.max(np.abs(halves[1][name] - value)))
                 for name, value in plain[1].items()}
        floor["<losses>"] = float(np.max(np.abs(np.array(halves[0]) - plain[0])))
        _REFERENCES[key] = (plain, floor)
    return _REFERENCES[key]


def assert_matches(result, reference_and_floor, amp: bool = False) -> None:
    """`result` equals the reference within the noise-floor tolerance (AMP: within
    float16's tolerance, as tests/passes/test_amp.py)."""
    from conftest import ATOL, NOISE_FACTOR, RTOL
    (losses, values, _), floor = reference_and_floor
    assert sorted(result[1]) == sorted(values)
    for name, value in values.items():
        if amp:
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                close = np.isclose(result[1][name], value, rtol=1e-2, atol=1e-3)
                assert close.mean() >= 0.9, name
            continue
        np.testing.assert_allclose(result[1][name], value, rtol=RTOL,
                                   atol=max(ATOL, NOISE_FACTOR * floor[name]), err_msg=name)
    tolerance = dict(rtol=1e-2, atol=1e-3) if amp else dict(
        rtol=RTOL, atol=max(ATOL, NOISE_FACTOR * floor["<losses>"]))
    np.testing.assert_allclose(result[0], losses, err_msg="per-step losses", **tolerance)
