"""The batch contract (`io.batch_mode`) on a model written like real TF1 code.

"replica" (the default, EPL's documented contract): the script's batch is one
replica's micro-batch; a step on R replicas x M micro-batches consumes R x M of
them. The oracle: after k steps the variables equal single-device training on
the concatenation of the batches the units consumed, in order (replica 0's
micro-batches first), and the fetched loss is their mean. Covered on the
BERT-like model (static batch from a drop_remainder pipeline, reshapes built
from Python ints, tf.compat.v1.layers, layer norm, tied output embedding)
under every strategy, and on the conftest models for feeds and constants.

"global" (opt-in): the script's batch is the worker's whole batch, sliced. A
batch size baked into a forward constant is refused before any op is added,
with an error naming the op.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.hooks.session import parallel_graph

import bert_like

MICRO = 4          # the script's batch (one unit's micro-batch)
STEPS = 3
EXAMPLES = bert_like.make_examples(96)
AMP_TOLERANCE = dict(rtol=1e-2, atol=1e-3)

# name -> (config, units per step, build kwargs); every layout consumes 4 batches a step
STRATEGIES = {
    "dp": ({"cluster.virtual_devices": 4}, {}),
    "ga": ({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}, {}),
    "pipeline_1f1b": ({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2,
                       "pipeline.strategy": "PreferBackward"}, {"stages": True}),
    "pipeline_gpipe": ({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2,
                        "pipeline.strategy": "PreferForward"}, {"stages": True}),
    "gc": ({"cluster.virtual_devices": 4, "gradient_checkpoint.type": "collection"},
           {"checkpoint_layers": True}),
    "gc_auto": ({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
                 "gradient_checkpoint.type": "auto"}, {}),
    "zero": ({"cluster.virtual_devices": 4, "zero.level": "v1"}, {}),
    "amp": ({"cluster.virtual_devices": 4, "amp.level": "O1"}, {}),
}
UNITS = 4


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_bert_like_matches_single_device_on_the_concatenated_batches(strategy):
    """Every unit draws its own static-shaped batch; the step equals single-device
    training on the 4 batches concatenated in order."""
    config, build_kwargs = STRATEGIES[strategy]
    builder = bert_like.build_pretraining
    result = bert_like.train(builder, MICRO, EXAMPLES, config, STEPS, **build_kwargs)
    parallel = parallel_graph(result[2])
    assert parallel.plan.num_replicas * int(config.get("pipeline.num_micro_batch", 1)) == UNITS
    bert_like.assert_matches(result, bert_like.reference(builder, UNITS * MICRO, EXAMPLES, STEPS),
                             amp=strategy == "amp")


def test_global_mode_refuses_a_baked_batch_size_before_any_op_is_added():
    """BERT's reshapes hold the batch size: slicing the batch cannot work, and the
    error names the op, its shape, the batch size and the remedy."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 4, "io.batch_mode": "global"}))
    with tf.Graph().as_default() as graph:
        bert_like.build_pretraining(UNITS * MICRO, EXAMPLES)
        before = len(graph.get_operations())
        with pytest.raises(epl.PassError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == before
    message = str(err.value)
    assert "io.batch_mode 'global' slices the batch of 16 examples into slices of 4, but " \
           "embeddings/Reshape_1 (type Reshape, shape (16, 16, 32)" in message
    assert "holds the whole batch in a constant and cannot run on a slice" in message
    assert "Build the shape with -1 or tf.shape(x)[0] instead of the batch size, or use " \
           "io.batch_mode 'replica'" in message


def test_dropout_differs_per_unit_and_a_seed_repeats_the_run():
    """With a graph seed, each replica and micro-batch draws its own dropout mask (the
    same masks would correlate the replicas); the same seed and layout give the same
    run."""
    def masks(seed):
        env.reset()
        epl.init(epl.Config({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}))
        with tf.Graph().as_default():
            tf.compat.v1.set_random_seed(seed)
            x = tf.compat.v1.placeholder(tf.float32, [MICRO, 64])
            with epl.replicate(1):
                kept = tf.compat.v1.layers.dropout(x, rate=0.5, training=True)
                w = tf.compat.v1.get_variable("w", [64, 1])
                loss = tf.reduce_mean(tf.matmul(kept, w))
            epl.add_to_collection(kept, epl.GraphKeys.GLOBAL_CONCAT_OBJECTS)
            train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                value = sess.run([kept, train_op], {x: np.ones([UNITS * MICRO, 64])})[0]
        env.reset()
        return value.reshape(UNITS, MICRO, 64) != 0

    first, again, other = masks(3), masks(3), masks(4)
    for u in range(UNITS):
        for v in range(u + 1, UNITS):
            assert (first[u] != first[v]).any(), f"units {u} and {v} drew the same mask"
    np.testing.assert_array_equal(first, again)
    assert (first != other).any()


def _feed_model(rows: int):
    x = tf.compat.v1.placeholder(tf.float32, [rows, 3], name="x")
    with epl.replicate(1):
        w = tf.compat.v1.get_variable("w", [3, 1], initializer=tf.ones_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
    outside = tf.reduce_sum(x)   # not part of the step: reads unit 0's rows
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
    return x, loss, outside, train_op


def test_feed_holds_every_unit_and_the_placeholder_keeps_its_shape():
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}))
    data = np.arange(UNITS * MICRO * 3, dtype=np.float32).reshape(UNITS * MICRO, 3) / 100
    with tf.Graph().as_default():
        x, loss, outside, train_op = _feed_model(MICRO)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            value, total = sess.run([loss, outside], {"x:0": data})   # a name works too
            np.testing.assert_allclose(value, np.mean(np.square(data.sum(1))), rtol=1e-6)
            np.testing.assert_allclose(total, data[:MICRO].sum(), rtol=1e-6)
            assert x.shape.as_list() == [MICRO, 3]
            with pytest.raises(epl.ParallelizeError) as err:
                sess.run(train_op, {x: data[:MICRO]})
    assert str(err.value) == (
        "the feed of placeholder x:0 (shape (4, 3)) holds 4 rows (shape (4, 3)), but this step "
        "runs 4 micro-batches of 4 (replicas x pipeline.num_micro_batch on this worker): feed "
        "16 rows, the micro-batches concatenated replica-major (io.batch_mode 'replica', EPL's "
        "contract). To feed one batch that EPL slices among the replicas instead, set "
        "io.batch_mode to 'global'.")


def test_iterator_draws_run_in_unit_order():
    """Unit u = replica x M + micro-batch takes the u-th batch of the step."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}))
    with tf.Graph().as_default():
        ids = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.range(1000).batch(MICRO, drop_remainder=True)).get_next()
        with epl.replicate(1):
            w = tf.compat.v1.get_variable("w", [], initializer=tf.ones_initializer())
            seen = tf.cast(ids, tf.float32) * w
            loss = tf.reduce_mean(seen)
        epl.add_to_collection(seen, epl.GraphKeys.GLOBAL_CONCAT_OBJECTS)
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.0).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(3):
                value = sess.run([seen, train_op])[0]
                first = step * UNITS * MICRO
                np.testing.assert_array_equal(value, np.arange(first, first + UNITS * MICRO))


def test_epl_quick_start_runs_as_written():
    """EPL's docs/en/quick_start.md with its TF2 compat edits: epl.init() (4 devices),
    a batch of 10, MonitoredTrainingSession. 500 examples make 50 batches; each step
    consumes 4 of them, so the iterator runs out during step 13 and the session stops
    after 12 steps."""
    env.reset()
    with tf.Graph().as_default():
        epl.init()
        epl.set_default_strategy(epl.replicate(1))
        num_x = np.random.randint(0, 10, (500, 20)).astype(dtype=np.float32)
        num_y = np.random.randint(0, 10, 500).astype(dtype=np.int64)
        dataset = tf.data.Dataset.from_tensor_slices((num_x, num_y)).batch(10).repeat(1)
        iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS,
                                       iterator.initializer)
        x, labels = iterator.get_next()
        logits = tf.compat.v1.layers.dense(x, 2)
        logits = tf.compat.v1.layers.dense(logits, 10)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        optimizer = tf.compat.v1.train.MomentumOptimizer(learning_rate=0.001, momentum=0.9)
        train_op = optimizer.minimize(loss, global_step=global_step)
        steps = []
        with tf.compat.v1.train.MonitoredTrainingSession() as sess:
            while not sess.should_stop():
                train_loss, _, step = sess.run([loss, train_op, global_step])
                assert np.isfinite(train_loss)
                steps.append(step)
    env.reset()
    assert len(steps) == 12


@pytest.mark.parametrize("mode", ["replica", "global"])
@pytest.mark.parametrize("strategy", ["dp", "ga_pipeline", "gc", "zero", "amp"])
def test_conftest_models_match_in_both_modes(models, epl_env, mode, strategy):
    """The conftest transformer (static placeholders) in both modes: in 'replica' mode
    the feed holds every unit's batch, in 'global' mode it is the batch EPL slices;
    both consume the same 8 rows and equal single-device training on them."""
    config = {"dp": {"cluster.virtual_devices": 4},
              "ga_pipeline": {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
              "gc": {"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto"},
              "zero": {"cluster.virtual_devices": 2, "zero.level": "v1"},
              "amp": {"cluster.virtual_devices": 2, "amp.level": "O1"}}[strategy]
    reference = models.single_device(model="transformer", optimizer="adam")
    epl_env({**config, "io.batch_mode": mode, "debug.check_invariants": True})
    result = models.train(5, model="transformer", optimizer="adam")   # as the reference
    if strategy == "amp":   # 90% of the elements within float16's tolerance (test_amp.py)
        for name, value in reference.variables.items():
            if name == "global_step" or "power" in name:
                continue
            close = np.isclose(result.variables[name], value, **AMP_TOLERANCE)
            assert close.mean() >= 0.9, name
        return
    models.assert_same_training(result, reference)


# --------------------------------------------------------------------------
# split models (tensor and expert parallelism) under the replica contract
# --------------------------------------------------------------------------


def _split_classifier(rows: int, use_epl: bool):
    """A replicated body and a class-split classifier with its loss inside the split."""
    import epl.layers as layers
    x = tf.compat.v1.placeholder(tf.float32, [rows, 6])
    y = tf.compat.v1.placeholder(tf.int64, [rows])
    with (epl.replicate(1, name="body") if use_epl else _nothing()):
        h = tf.compat.v1.layers.dense(x, 16, activation=tf.nn.relu, name="body",
                                      kernel_initializer=_init([6, 16], 1))
        h = tf.reshape(h, [rows, 16])   # a reshape with the batch size baked in
    with (epl.split(4, name="classifier") if use_epl else _nothing()):
        logits = layers.dense(h, 40, kernel_initializer=_init([16, 40], 2), name="classifier")
        loss = layers.sparse_softmax_cross_entropy(y, logits)
    return loss, lambda rng, n: {x: rng.randn(n, 6), y: rng.randint(0, 40, n)}


def _split_moe(rows: int, use_epl: bool):
    """A mixture-of-experts layer whose 8 experts are split over 4 devices."""
    import epl.layers as layers
    x = tf.compat.v1.placeholder(tf.float32, [rows, 6, 8])
    y = tf.compat.v1.placeholder(tf.float32, [rows, 6, 8])
    if use_epl:
        epl.set_default_strategy(epl.replicate(1))
    out, aux = layers.moe(x, 8, 16, k=2, capacity_factor=2.0, split_devices=4)
    loss = tf.reduce_mean(tf.square(out - y)) + 0.01 * aux
    return loss, lambda rng, n: {x: rng.randn(n, 6, 8), y: rng.randn(n, 6, 8)}


def _split_embedding(rows: int, use_epl: bool):
    """A vocabulary-split embedding table feeding a replicated body."""
    ids = tf.compat.v1.placeholder(tf.int32, [rows, 5])
    y = tf.compat.v1.placeholder(tf.float32, [rows, 3])
    with (epl.split(4, name="embedding") if use_epl else _nothing()):
        table = tf.compat.v1.get_variable("table", [40, 8], initializer=_init([40, 8], 5))
        emb = tf.nn.embedding_lookup(table, ids)
    with (epl.replicate(1, name="body") if use_epl else _nothing()):
        pooled = tf.reduce_mean(emb, axis=1)
        out = tf.compat.v1.layers.dense(pooled, 3, kernel_initializer=_init([8, 3], 6),
                                        name="head")
        loss = tf.reduce_mean(tf.square(out - y))
    return loss, lambda rng, n: {ids: rng.randint(0, 40, (n, 5)), y: rng.randn(n, 3)}


def _nothing():
    import contextlib
    return contextlib.nullcontext()


def _init(shape, seed, scale=0.3):
    return tf.constant_initializer(np.random.RandomState(seed).randn(*shape) * scale)


def _train_split(build, rows: int, config: dict | None, steps: int = 3):
    """(losses, full variable values, graph); with EPL the feed holds every replica's
    `rows`, without it `rows` rows."""
    from epl.checkpoint.sharded_variable import full_values
    env.reset()
    if config is not None:
        epl.init(epl.Config({"debug.check_invariants": True, **config}))
    with tf.Graph().as_default() as graph:
        tf.compat.v1.set_random_seed(7)
        loss, make_feed = build(rows, config is not None)
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
        replicas = epl.parallelize(graph).plan.num_replicas if config is not None else 1
        feed = make_feed(np.random.RandomState(0), replicas * rows)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([train_op, loss], feed)[1]) for _ in range(steps)]
            values = full_values(sess, graph)
    env.reset()
    return losses, values, graph


@pytest.mark.parametrize("name,build,colocate", [
    ("classifier", _split_classifier, False),
    ("moe", _split_moe, True),
    ("embedding", _split_embedding, True),
])
def test_split_models_match_single_device_on_the_concatenated_batches(name, build, colocate):
    """Each replica's rows go through the split ops at the script's static shapes; the
    shards see every replica's rows and are updated once."""
    config = {"cluster.colocate_split_and_replicate": colocate}
    result = _train_split(build, MICRO, config)
    replicas = parallel_graph(result[2]).plan.num_replicas
    assert replicas == 4
    reference = _train_split(build, replicas * MICRO, None)
    for key, value in reference[1].items():
        np.testing.assert_allclose(result[1][key], value, rtol=2e-5, atol=2e-6, err_msg=key)
    np.testing.assert_allclose(result[0], reference[0], rtol=2e-5, atol=2e-6)
