"""epl.init after the optimizer step was built: a clear error, at once."""
import numpy as np
import pytest
import tensorflow as tf

import epl


def test_init_after_minimize_is_refused():
    with tf.Graph().as_default():
        x = tf.constant(np.ones([4, 3], np.float32))
        w = tf.compat.v1.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.matmul(x, w))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(epl.ConfigError) as err:
            epl.init(epl.Config({"cluster.virtual_devices": 2}))
        assert str(err.value) == (
            "epl.init() was called after the optimizer built the training step: the default "
            "graph already has 1 variable update (GradientDescent/update_w/"
            "ResourceApplyGradientDescent, type ResourceApplyGradientDescent), made by "
            "minimize() or apply_gradients() before EPL was initialized, so EPL did not record "
            "the step. Call epl.init() first, then build the model and the optimizer step.")
    from epl import env
    assert not env.is_initialized()


def test_init_before_minimize_is_fine():
    with tf.Graph().as_default():
        epl.init(epl.Config({"cluster.virtual_devices": 2}))
        x = tf.constant(np.ones([4, 3], np.float32))
        w = tf.compat.v1.get_variable("w", [3, 1])
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.matmul(x, w)))
