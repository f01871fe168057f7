"""The user's variables under epl.split read as their full single-device values.

A variable created under epl.split is stored as shards (epl/checkpoint/sharded_variable.py);
the user's variable object stays a view of them: `sess.run(v)`, reads built after
minimize(), `tf.compat.v1.trainable_variables()` (single-device names), an
optimizer created after the split, a Saver given the trainable variables,
`v.assign`. Oracles in both batch contracts (tests/split_oracle.py), exact errors
where a write cannot reach the shards.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.checkpoint.sharded_variable import full_values, shard_existing, sharded_of, shards_of
from split_oracle import REPLICAS, ROWS, assert_matches_single_device

CLASSES = 40


def _init(shape, seed, scale=0.3):
    return tf.compat.v1.constant_initializer(
        np.random.RandomState(seed).randn(*shape).astype(np.float32) * scale)


def _scope(strategy):
    return strategy if env.is_initialized() else contextlib.nullcontext()


def classifier(use_resource: bool = True, gradient_norm: bool = False):
    """A replicated body, a classifier split by classes over 4 devices, and a weight
    decay over tf.compat.v1.trainable_variables() (built before minimize(), outside
    the split scope, as training scripts do). gradient_norm: also build the
    gradients' global norm with a first optimizer (which runs the split), so that
    the training optimizer (the oracle's AdamOptimizer) is created after the split
    and reads the trainable variables itself."""
    def build(rows: int):
        x = tf.compat.v1.placeholder(tf.float32, [rows, 6], name="features")
        y = tf.compat.v1.placeholder(tf.int64, [rows], name="labels")

        def model(features, labels):
            with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                             use_resource=use_resource):
                with _scope(epl.replicate(1, name="body")):
                    hidden = tf.compat.v1.layers.dense(features, 16, activation=tf.nn.relu,
                                                       kernel_initializer=_init([6, 16], 1),
                                                       name="body")
                with _scope(epl.split(4, name="classifier")):
                    kernel = tf.compat.v1.get_variable("cls_w", [16, CLASSES],
                                                       initializer=_init([16, CLASSES], 2))
                    bias = tf.compat.v1.get_variable("cls_b", [CLASSES],
                                                     initializer=_init([CLASSES], 3, 0.1))
                    logits = tf.matmul(hidden, kernel) + bias
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                        labels=labels, logits=logits))
                decay = tf.add_n([tf.nn.l2_loss(v) for v in tf.compat.v1.trainable_variables()])
                loss = loss + 1e-3 * decay
            if gradient_norm:
                grads = tf.compat.v1.train.GradientDescentOptimizer(0.1).compute_gradients(loss)
                tf.compat.v1.add_to_collection("gradient_norm",
                                               tf.linalg.global_norm([g for g, _ in grads]))
            return loss

        def feed(rng, n):
            return {x: rng.randn(n, 6), y: rng.randint(0, CLASSES, n)}
        return model, (x, y), feed
    return build


@pytest.mark.parametrize("mode", ["replica", "global"])
@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "reference"])
def test_user_variables_read_whole_and_train_like_single_device(mode, use_resource):
    """trainable_variables() lists cls_w and cls_b (not their parts), sess.run on each
    returns the full value, and training (with a weight decay that reads them outside
    the split scope) matches single-device TensorFlow."""
    graph = assert_matches_single_device(f"classifier_{use_resource}",
                                         classifier(use_resource), mode)
    with graph.as_default():
        names = [v.op.name for v in tf.compat.v1.trainable_variables()]
    assert names == ["body/kernel", "body/bias", "cls_w", "cls_b"]
    (kernel,) = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
                 if v.op.name == "cls_w"]
    assert [s.op.name for s in shards_of(kernel)] == [f"cls_w/part_{j}" for j in range(4)]
    assert sorted(s.device for s in shards_of(kernel)) == [f"/device:CPU:{j}" for j in range(4)]
    assert (sharded_of(kernel).axis, sharded_of(kernel).sizes) == (1, (10, 10, 10, 10))


def test_optimizer_created_after_the_split_trains_every_variable():
    """A first optimizer's compute_gradients (a gradient-norm metric) runs the split;
    the training optimizer, created afterwards, takes minimize()'s default var_list
    from the trainable collection: the user's variables, which it trains as shards.
    (Replica mode: under io.batch_mode "global" a metric computed from gradients of
    the sliced batch is refused by the replicate pass, split or not.)"""
    assert_matches_single_device("classifier_gradient_norm", classifier(gradient_norm=True),
                                 "replica")


def _build_trained(use_resource: bool = True):
    """An EPL graph of `classifier` (replica mode) with its train op; (graph, train_op, feed)."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": REPLICAS}))
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(7)
        model, inputs, feed = classifier(use_resource)(ROWS // REPLICAS)
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(model(*inputs))
    return graph, train_op, feed(np.random.RandomState(0), ROWS)


def _user_variable(graph, name):
    (variable,) = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
                   if v.op.name == name]
    return variable


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "reference"])
def test_reads_built_after_minimize_see_the_full_value(use_resource):
    graph, train_op, data = _build_trained(use_resource)
    with graph.as_default():
        kernel, bias = _user_variable(graph, "cls_w"), _user_variable(graph, "cls_b")
        reads = {"identity": tf.identity(kernel), "read_value": kernel.read_value(),
                 "arithmetic": bias * 2.0, "gather": tf.gather(bias, [3, 17, 39]),
                 "slice": kernel[:, 5:25], "initialized_value": bias.initialized_value(),
                 "gather_nd": tf.compat.v1.gather_nd(kernel, [[0, 39], [15, 0]])}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op, data)
            stored = full_values(sess, graph)
            values = sess.run(reads)
            np.testing.assert_array_equal(sess.run(kernel), stored["cls_w"])
            np.testing.assert_array_equal(kernel.eval(sess), stored["cls_w"])
    env.reset()
    np.testing.assert_array_equal(values["identity"], stored["cls_w"])
    np.testing.assert_array_equal(values["read_value"], stored["cls_w"])
    np.testing.assert_array_equal(values["arithmetic"], stored["cls_b"] * 2.0)
    np.testing.assert_array_equal(values["gather"], stored["cls_b"][[3, 17, 39]])
    np.testing.assert_array_equal(values["slice"], stored["cls_w"][:, 5:25])
    np.testing.assert_array_equal(values["initialized_value"], stored["cls_b"])
    np.testing.assert_array_equal(values["gather_nd"], stored["cls_w"][[0, 15], [39, 0]])


def test_assign_and_initializer_reach_every_shard():
    graph, _, _ = _build_trained()
    with graph.as_default():
        kernel = _user_variable(graph, "cls_w")
        new = np.arange(16 * CLASSES, dtype=np.float32).reshape(16, CLASSES)
        assign = kernel.assign(new)
        add = kernel.assign_add(np.ones([16, CLASSES], np.float32), read_value=False)
        with tf.compat.v1.Session() as sess:
            # the user's variable's own initializer initializes its shards
            sess.run(tf.compat.v1.variables_initializer(tf.compat.v1.trainable_variables()))
            assert sess.run(kernel.is_initialized())
            np.testing.assert_array_equal(sess.run(assign), new)
            sess.run(add)
            shards = sess.run(shards_of(kernel))
    env.reset()
    np.testing.assert_array_equal(np.concatenate(shards, axis=1), new + 1)


def test_saver_given_the_trainable_variables_keeps_single_device_names(tmp_path):
    """Saver(trainable_variables()) and Saver({name: variable}) save the shards as
    one full tensor per variable and restore into them; a plain single-device
    script restores the checkpoint."""
    path = os.path.join(str(tmp_path), "model.ckpt")
    graph, train_op, data = _build_trained()
    with graph.as_default():
        saver = tf.compat.v1.train.Saver(tf.compat.v1.trainable_variables())
        by_name = tf.compat.v1.train.Saver({"classifier_bias": _user_variable(graph, "cls_b")})
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op, data)
            trained = full_values(sess, graph)
            saver.save(sess, path)
            by_name.save(sess, path + "-bias")
            sess.run(tf.compat.v1.global_variables_initializer())   # forget the training
            saver.restore(sess, path)
            restored = {name: sess.run(_user_variable(graph, name)) for name in ("cls_w", "cls_b")}
    env.reset()
    assert dict(tf.train.list_variables(path)) == {
        "body/kernel": [6, 16], "body/bias": [16], "cls_w": [16, CLASSES], "cls_b": [CLASSES]}
    assert dict(tf.train.list_variables(path + "-bias")) == {"classifier_bias": [CLASSES]}
    for name in ("cls_w", "cls_b"):
        np.testing.assert_array_equal(restored[name], trained[name])
    with tf.Graph().as_default():   # a plain single-device script
        model, inputs, _ = classifier()(ROWS)
        model(*inputs)
        with tf.compat.v1.Session() as sess:
            tf.compat.v1.train.Saver(tf.compat.v1.trainable_variables()).restore(sess, path)
            plain = sess.run({v.op.name: v for v in tf.compat.v1.trainable_variables()})
    for name, value in plain.items():
        np.testing.assert_array_equal(value, trained[name], err_msg=name)


def test_monitored_session_with_checkpoints_and_summaries(tmp_path):
    """MonitoredTrainingSession (readiness check, default Saver, meta graph export with
    the user's variables in the trainable collection) and a histogram summary of every
    trainable variable."""
    graph, train_op, data = _build_trained()
    with graph.as_default():
        for variable in tf.compat.v1.trainable_variables():
            tf.compat.v1.summary.histogram(variable.op.name, variable)
        step = tf.compat.v1.train.get_or_create_global_step()
        train_op = tf.group(train_op, step.assign_add(1))
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=str(tmp_path), save_summaries_steps=1) as sess:
            for _ in range(2):
                sess.run(train_op, data)
            kernel = sess.run(_user_variable(graph, "cls_w"))
    env.reset()
    checkpoint = tf.train.latest_checkpoint(str(tmp_path))
    assert dict(tf.train.list_variables(checkpoint))["cls_w"] == [16, CLASSES]
    np.testing.assert_array_equal(tf.train.load_variable(checkpoint, "cls_w"), kernel)


def test_writes_that_cannot_reach_the_shards_are_refused():
    graph, _, _ = _build_trained(use_resource=False)
    with graph.as_default():
        kernel = _user_variable(graph, "cls_w")
        with pytest.raises(epl.ParallelizeError) as err:
            tf.compat.v1.assign(kernel, tf.zeros([16, CLASSES]))
        assert str(err.value) == (
            "variable cls_w is split by epl.split into 4 shards and has no single reference "
            "tensor (an op taking a reference, such as tf.compat.v1.assign, would write storage "
            "that is never used). Use the variable's own methods (assign, assign_add, "
            "assign_sub), which write every shard, or its shards "
            "(epl.checkpoint.sharded_variable.shards_of(variable)).")
        with pytest.raises(epl.ParallelizeError) as err:
            kernel.scatter_update(tf.IndexedSlices(tf.zeros([1, CLASSES]), tf.constant([0])))
        assert str(err.value) == (
            "variable cls_w is split by epl.split into 4 shards along axis 1: "
            "Variable.scatter_update is not supported on it. Use assign (it writes every shard "
            "its slice), or apply the update to its shards "
            "(epl.checkpoint.sharded_variable.shards_of(variable)).")
    env.reset()


def test_a_worker_holding_some_shards_refuses_to_read_the_whole():
    """A split group spanning workers: each worker holds its own shards only."""
    with tf.Graph().as_default():
        variable = tf.compat.v1.get_variable("table", [8, 4])
        sharded = shard_existing(variable, 0, [2, 2], ["/device:CPU:0", "/device:CPU:1"],
                                 "/device:CPU:0", lambda j: {}, offsets=[4, 6])
        message = ("variable table (shape [8, 4]) is split by epl.split over several workers; "
                   "this worker holds only entries 4 to 8 of axis 0, so it cannot read the whole "
                   "variable. Read this worker's shards (epl.checkpoint.sharded_variable.shards_of("
                   "variable)), or save a checkpoint on every worker.")
        for read in (lambda: tf.identity(variable), variable.read_value,
                     lambda: tf.compat.v1.Session().run(variable)):
            with pytest.raises(epl.ParallelizeError) as err:
                read()
            assert str(err.value) == message
        assert shards_of(variable) == sharded.shards


def test_object_based_checkpoint_saves_and_restores_the_full_value(tmp_path):
    """tf.compat.v1.train.Checkpoint (object-based) on a split variable: one full tensor."""
    graph, train_op, data = _build_trained()
    with graph.as_default():
        kernel = _user_variable(graph, "cls_w")
        checkpoint = tf.compat.v1.train.Checkpoint(kernel=kernel)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op, data)
            trained = sess.run(kernel)
            path = checkpoint.save(os.path.join(str(tmp_path), "object"), session=sess)
            sess.run(tf.compat.v1.global_variables_initializer())   # forget the training
            checkpoint.restore(path).run_restore_ops(sess)
            restored = sess.run(kernel)
    env.reset()
    assert dict(tf.train.list_variables(path))["kernel/.ATTRIBUTES/VARIABLE_VALUE"] == [16, CLASSES]
    np.testing.assert_array_equal(restored, trained)
    initial = np.random.RandomState(2).randn(16, CLASSES).astype(np.float32) * 0.3
    assert not np.allclose(trained, initial)   # training moved it: the restore did the work
