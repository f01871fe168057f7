"""Gradient checkpointing inside EPL: same numbers with data parallelism and pipelines."""
import pytest
import tensorflow as tf

import epl
from epl.ir.recompute import RECOMPUTE_ATTR


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
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            assert result.gradient_check_max_diff is None
            sess.run(built.train_op, built.feed)
    assert result.gradient_check_max_diff is not None
    assert 0.0 <= result.gradient_check_max_diff < 1e-5
