"""Gradient checkpointing inside EPL: same numbers with data parallelism and pipelines."""
import numpy as np
import pytest
import tensorflow as tf

import epl
from epl.passes import unit_functions
from epl.passes.recompute.checkpoints import RECOMPUTE_ATTR


def _recompute_ops(graph):
    return [op for op in graph.get_operations() if RECOMPUTE_ATTR in op.node_def.attr]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_auto_checkpointing_with_data_parallelism(models, epl_env, model):
    reference = models.single_device(model=model, optimizer="adam")
    config = {"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto"}
    epl_env(config)
    models.assert_same_training(models.train(model=model, optimizer="adam"), reference)
    epl_env(config)
    with tf.Graph().as_default() as graph:
        models.build(model, "adam")
        epl.parallelize(graph)
    assert _recompute_ops(graph)


def test_collection_checkpointing(models, epl_env):
    reference = models.single_device(model="mlp", optimizer="sgd")
    epl_env({"cluster.virtual_devices": 2, "gradient_checkpoint.type": "collection"})
    with tf.Graph().as_default() as graph:
        built = models.build("mlp", "sgd")
        relus = [op.outputs[0] for op in graph.get_operations() if op.type == "Relu"]
        tf.compat.v1.add_to_collection("checkpoints", relus[0])
        epl.parallelize(graph)
        assert _recompute_ops(graph)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([built.train_op, built.loss], built.feed)[1] for _ in range(5)]
            values = models.variable_values(sess, graph)
    for name, value in reference.variables.items():
        import numpy as np
        np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, reference.losses, rtol=1e-5, atol=1e-6)


def test_empty_checkpoint_collection_is_an_error(models, epl_env):
    epl_env({"cluster.virtual_devices": 2, "gradient_checkpoint.type": "collection"})
    with tf.Graph().as_default() as graph:
        models.build("mlp", "sgd")
        before = len(graph.get_operations())
        with pytest.raises(epl.PassError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == before
    assert "gradient_checkpoint.type is 'collection' but the 'checkpoints' collection is empty" \
        in str(err.value)


def test_auto_checkpointing_with_pipeline(models, epl_env):
    reference = models.single_device(model="transformer", optimizer="sgd")
    epl_env({"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto",
             "pipeline.num_micro_batch": 2})
    models.assert_same_training(models.train(model="transformer", optimizer="sgd"), reference)


def test_check_gradients_reports_the_largest_difference(models, epl_env):
    epl_env({"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto",
             "gradient_checkpoint.check_gradients": True})
    with tf.Graph().as_default() as graph:
        built = models.build("transformer", "sgd")
        result = epl.parallelize(graph)
        assert result.gradient_check is not None
        # the checkpointed gradients compared are the ones the step computes: the
        # unit functions' calls return them (their unread copies are not fetched)
        assert all(g.op.type in unit_functions.CALL_TYPES
                   for g in result.gradient_check[1] if g is not None)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            assert result.gradient_check_max_diff is None
            sess.run(built.train_op, built.feed)
    assert result.gradient_check_max_diff is not None
    assert 0.0 <= result.gradient_check_max_diff < 1e-5


@pytest.mark.parametrize("mode", ["replica", "global"])
def test_check_gradients_consumes_no_input(models, epl_env, mode):
    """The check runs on the batches the first step uses: with a tf.data iterator of
    distinct batches, training with the check equals training without it."""
    def run(check):
        epl_env({"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto",
                 "gradient_checkpoint.check_gradients": check, "io.batch_mode": mode})
        units = 2 if mode == "replica" else 1
        with tf.Graph().as_default() as graph:
            x = np.random.RandomState(3).randn(64, 4, 8).astype(np.float32)
            y = np.eye(4, dtype=np.float32)[np.random.RandomState(4).randint(0, 4, 64)]
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8 // units).repeat()
            features, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
            with epl.replicate(1):
                loss = models_loss(features, labels)
            train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                losses = [sess.run([train_op, loss])[1] for _ in range(3)]
                values = sess.run(tf.compat.v1.trainable_variables())
            checked = epl.parallelize(graph).gradient_check_max_diff
        return losses, values, checked

    def models_loss(features, labels):
        return models.LOSSES["transformer"](features, labels, models.make_params("transformer"))

    plain, checked = run(False), run(True)
    assert plain[2] is None and checked[2] is not None and checked[2] < 1e-5
    # float tolerance (the check's extra ops may change how TensorFlow fuses the step);
    # a batch consumed by the check would move the losses by orders of magnitude more
    np.testing.assert_allclose(checked[0], plain[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(checked[1], plain[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_check_gradients_leaves_training_with_dropout_as_without_it(epl_env):
    """The check fetches both gradient lists in the first training run itself: no extra
    forward pass draws dropout masks (or batches), so training with the check is the
    training without it (a separate check run made the losses differ by up to 1.06)."""
    def run(check):
        epl_env({"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto",
                 "gradient_checkpoint.check_gradients": check})
        data = np.random.RandomState(2).randn(8, 16).astype(np.float32)
        with tf.Graph().as_default() as graph:
            tf.compat.v1.set_random_seed(7)
            x = tf.compat.v1.placeholder(tf.float32, [4, 16])
            with epl.replicate(1):
                h = tf.compat.v1.layers.dense(x, 16, activation=tf.nn.relu, name="h",
                                              kernel_initializer=tf.constant_initializer(0.1))
                h = tf.compat.v1.layers.dropout(h, rate=0.5, training=True)
                h = tf.compat.v1.layers.dense(h, 16, activation=tf.nn.relu, name="h2",
                                              kernel_initializer=tf.constant_initializer(0.1))
                loss = tf.reduce_mean(tf.square(h - 1.0))
            train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                losses = [sess.run([train_op, loss], {x: data})[1] for _ in range(4)]
            return losses, epl.parallelize(graph).gradient_check_max_diff

    plain, checked = run(False), run(True)
    assert checked[1] is not None and checked[1] < 1e-5
    np.testing.assert_allclose(checked[0], plain[0], rtol=1e-6, atol=1e-7)
