"""Each bad input of the core issue gets a clear error, and nothing half-done."""
import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env


@pytest.fixture(autouse=True)
def fresh_epl():
    env.reset()
    yield
    env.reset()


def _mlp(batch=8, scope=True, optimizer=True):
    """A tiny MLP on a placeholder batch; returns (x, y, loss, train_op or None)."""
    x = tf.compat.v1.placeholder(tf.float32, [batch, 4])
    y = tf.compat.v1.placeholder(tf.int64, [batch])
    ctx = epl.replicate(device_count=1, name="body") if scope else None
    if ctx:
        ctx.__enter__()
    w = tf.compat.v1.get_variable("w", initializer=np.ones([4, 3], np.float32))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(x, w)))
    if ctx:
        ctx.__exit__(None, None, None)
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss) if optimizer else None
    return x, y, loss, train


def test_nested_scopes():
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default():
        with epl.replicate(1, name="outer"):
            with pytest.raises(epl.ScopeError) as err:
                with epl.split(2, name="inner"):
                    pass
    assert str(err.value).startswith(
        "epl.split(device_count=2, name='inner') was opened inside "
        "epl.replicate(device_count=1, name='outer'); strategy scopes cannot be nested.")


def test_device_count_larger_than_devices():
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [8, 4])
        with epl.replicate(device_count=4, name="wide"):
            w = tf.compat.v1.get_variable("w", [4, 1])
            loss = tf.reduce_mean(tf.matmul(x, w))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        ops_before = len(graph.get_operations())
        with pytest.raises(epl.ClusterError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == ops_before  # nothing rewritten
    assert "epl.replicate(device_count=4, name='wide') needs 4 device(s) per replica" in str(err.value)
    assert "this worker has 2 CPU device(s)" in str(err.value)
    assert "cluster.virtual_devices" in str(err.value)


def test_device_count_not_dividing_devices():
    epl.init(epl.Config({"cluster.virtual_devices": 4}))
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [8, 4])
        with epl.replicate(device_count=3, name="odd"):
            w = tf.compat.v1.get_variable("w", [4, 1])
            loss = tf.reduce_mean(tf.matmul(x, w))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(epl.ClusterError) as err:
            epl.parallelize(graph)
    assert "one replica spans 3 device(s) (odd=3), which does not divide the 4 CPU devices" in str(err.value)


def test_batch_not_divisible_static():
    epl.init(epl.Config({"cluster.virtual_devices": 4, "io.batch_mode": "global"}))
    with tf.Graph().as_default() as graph:
        _mlp(batch=6)
        ops_before = len(graph.get_operations())
        with pytest.raises(epl.PassError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == ops_before
    message = str(err.value)
    assert "pass 'replicate' rejected the graph before any rewrite" in message
    assert "the global batch of 6 examples cannot be split evenly over 4 replicas" in message
    assert ("Use a global batch size divisible by 4, or io.batch_mode 'replica' (the default: "
            "the script's batch is one replica's micro-batch).") in message


def test_batch_not_divisible_at_run_time():
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default():
        x, y, loss, train = _mlp(batch=None)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train, {x: np.ones([4, 4]), y: np.zeros([4])})  # divisible: fine
            with pytest.raises(tf.errors.InvalidArgumentError) as err:
                sess.run(train, {x: np.ones([3, 4]), y: np.zeros([3])})
    assert "EPL: the batch cannot be split evenly over 2 replicas; rows:] [3]" in str(err.value)


def test_unknown_config_key_and_value():
    with pytest.raises(epl.ConfigError) as err:
        epl.Config({"pipeline.num_micro_batches": 2})
    assert "Did you mean 'pipeline.num_micro_batch'?" in str(err.value)
    with pytest.raises(epl.ConfigError) as err:
        epl.Config({"pipeline.strategy": "Fastest"})
    assert "PreferBackward" in str(err.value) and "PreferForward" in str(err.value)


def test_eager_mode():
    """An eager scope needs epl.init first (it creates the devices before TensorFlow's
    first op), and one around code that builds nothing EPL parallelizes says what works."""
    assert tf.executing_eagerly()
    with pytest.raises(epl.ScopeError) as err:
        with epl.replicate(1, name="body"):
            pass
    assert str(err.value) == (
        "epl.replicate(device_count=1, name='body') was used in eager mode before epl.init(): "
        "call epl.init() first (it creates the devices EPL trains on, before TensorFlow runs "
        "its first op), then build the model.")
    epl.init()
    with pytest.raises(epl.ScopeError) as err:
        with epl.replicate(1):
            pass
    assert "was used in eager mode around code that built nothing EPL can parallelize" \
        in str(err.value)
    assert "tf.compat.v1.disable_eager_execution()" in str(err.value)


def test_strategy_without_optimizer_step():
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default():
        _, _, loss, _ = _mlp(optimizer=False)
        with pytest.raises(epl.ParallelizeError) as err:
            tf.compat.v1.Session()
    assert "the graph has EPL strategy annotations but no training step" in str(err.value)
    assert ("(Optimizer.minimize, compute_gradients or tf.gradients, then apply_gradients or "
            "assign ops); no gradients were built") in str(err.value)


def test_bad_device_count_value():
    with pytest.raises(epl.ScopeError) as err:
        epl.replicate(device_count=0)
    assert "device_count must be a positive integer" in str(err.value)
