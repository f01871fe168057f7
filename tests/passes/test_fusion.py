"""Gradient communication: fusion buckets, fp16 compression, sparse gradients."""
import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.ir.collectives import is_reduction_to_one_device
from epl.passes.gradient_comm import plan_buckets

MB = 1 << 20


def _collectives(graph):
    """The all-reduces: TensorFlow's collective (one op per device), or on CPU devices
    by default the sum on one device (one AddN)."""
    return [op for op in graph.get_operations()
            if op.type == "CollectiveReduce" or is_reduction_to_one_device(op)]


def test_bucket_plan_follows_threshold_and_reverse_order():
    with tf.Graph().as_default():
        grads = [tf.zeros([256, 256]), tf.zeros([256]), tf.zeros([256, 256]), tf.zeros([10], tf.float16)]
    buckets = plan_buckets(grads, threshold_bytes=300_000, max_splits=0)
    # float32: 262144 B + 1024 B + 262144 B with a 300 kB limit -> [2, 1] and [0]; float16 apart
    assert [b.members for b in buckets] == [[3], [2, 1], [0]]
    assert [b.dtype for b in buckets] == [tf.float16, tf.float32, tf.float32]
    one = plan_buckets(grads, threshold_bytes=128 * MB, max_splits=0)
    assert sorted(len(b.members) for b in one) == [1, 3]
    tiny = plan_buckets(grads, threshold_bytes=1, max_splits=0)
    assert len(tiny) == 4
    capped = plan_buckets(grads, threshold_bytes=1, max_splits=2)
    assert len([b for b in capped if b.dtype == tf.float32]) == 2


@pytest.mark.parametrize("reduction,ops_per_bucket", [("collective", 2), ("one_device", 1)])
@pytest.mark.parametrize("threshold_mb,expected", [(128, 1), (0.000001, 7)])
def test_collective_count_equals_bucket_count(models, epl_env, threshold_mb, expected,
                                              reduction, ops_per_bucket):
    epl_env({"cluster.virtual_devices": 2, "communication.fusion_threshold_mb": threshold_mb,
             "communication.max_splits": 0,   # no cap on the bucket count
             "communication.local_reduction": reduction})
    with tf.Graph().as_default() as graph:
        built = models.build("mlp", "sgd")
        epl.parallelize(graph)
    # 6 variables + none for global_step: one bucket (fused) or 6 (unfused); a collective
    # has one op per replica, the sum on one device one AddN
    expected_buckets = 1 if expected == 1 else 6
    assert len(_collectives(graph)) == ops_per_bucket * expected_buckets
    del built


@pytest.mark.parametrize("config", [
    {"communication.fusion_threshold_mb": 128},
    {"communication.fusion_threshold_mb": 0.000001, "communication.max_splits": 0},
    {"communication.fusion_threshold_mb": 0.000001},   # max_splits 5 (default)
    {"communication.fusion_threshold_mb": 0.000001, "communication.max_splits": 2},
])
def test_fused_and_unfused_equal_single_device(models, epl_env, config):
    reference = models.single_device(model="mlp", optimizer="adam")
    epl_env({"cluster.virtual_devices": 4, **config})
    models.assert_same_training(models.train(model="mlp", optimizer="adam"), reference)


def test_fp16_compression_within_fp16_tolerance(models, epl_env):
    reference = models.single_device(model="mlp", optimizer="sgd")
    epl_env({"cluster.virtual_devices": 4, "communication.fp16": True})
    result = models.train(model="mlp", optimizer="sgd")
    for name, value in reference.variables.items():
        np.testing.assert_allclose(result.variables[name], value, rtol=2e-3, atol=2e-3)
    with tf.Graph().as_default() as graph:
        models.build("mlp", "sgd")
        epl.parallelize(graph)
    assert {op.get_attr("T") for op in _collectives(graph)} == {tf.float16}


def _embedding_train(optimizer, sparse_as_dense=False, devices=None, steps=4):
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 20, size=[8, 3]).astype(np.int64)
    ids[:, 0] = 5  # every replica touches row 5: duplicate indices across replicas
    targets = rng.randn(8, 4).astype(np.float32)
    table0 = rng.randn(20, 4).astype(np.float32)
    with tf.Graph().as_default() as graph:
        x = tf.constant(ids)
        y = tf.constant(targets)
        if devices:
            with epl.replicate(1):
                table = tf.compat.v1.get_variable("table", initializer=table0)
                loss = tf.reduce_mean(tf.square(tf.reduce_sum(tf.gather(table, x), axis=1) - y))
        else:
            table = tf.compat.v1.get_variable("table", initializer=table0)
            loss = tf.reduce_mean(tf.square(tf.reduce_sum(tf.gather(table, x), axis=1) - y))
        opt = (tf.compat.v1.train.AdamOptimizer(0.05) if optimizer == "adam"
               else tf.compat.v1.train.GradientDescentOptimizer(0.5))
        train = opt.minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([train, loss])[1] for _ in range(steps)]
            return losses, sess.run(table), graph


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients(epl_env, optimizer, sparse_as_dense):
    env.reset()
    ref_losses, ref_table, _ = _embedding_train(optimizer)
    epl_env({"cluster.virtual_devices": 2, "communication.sparse_as_dense": sparse_as_dense})
    losses, table, graph = _embedding_train(optimizer, sparse_as_dense, devices=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(table, ref_table, rtol=1e-5, atol=1e-6)
    assert bool(_collectives(graph)) == sparse_as_dense


def _mixed_shapes_train(devices=None, replica_weights=None):
    """Adam on a scalar, a vector and a variable of unknown static shape (its gradient's
    shape is only known at run time): the three kinds a bucket flattens differently."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(8, 6).astype(np.float32), rng.randn(8, 3).astype(np.float32)
    w0, b0 = rng.randn(6, 3).astype(np.float32), rng.randn(3).astype(np.float32)
    with tf.Graph().as_default() as graph:
        def loss_fn():
            w = tf.compat.v1.get_variable(
                "w", initializer=tf.compat.v1.placeholder_with_default(w0, shape=None),
                validate_shape=False)
            b = tf.compat.v1.get_variable("b", initializer=b0)
            s = tf.compat.v1.get_variable("s", initializer=np.float32(0.7))
            pred = tf.matmul(tf.constant(x), tf.reshape(w, [6, 3])) * s + b
            return tf.reduce_mean(tf.square(pred - tf.constant(y)))
        if devices:
            with epl.replicate(1):
                loss = loss_fn()
        else:
            loss = loss_fn()
        train = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
        if devices:
            epl.parallelize(graph, replica_weights=replica_weights)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(3):
                sess.run(train)
            return {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()
                    if v.op.name in ("w", "b", "s")}


@pytest.mark.parametrize("config,weights", [
    ({}, None),
    ({"io.batch_mode": "global"}, [0.25, 0.75]),   # uneven shares slice one batch
    ({"communication.fusion_threshold_mb": 0.000001, "communication.max_splits": 0}, None),
])
def test_scalar_vector_and_dynamic_shape_gradients(epl_env, config, weights):
    reference = _mixed_shapes_train()
    epl_env({"cluster.virtual_devices": 2, **config})
    result = _mixed_shapes_train(devices=2, replica_weights=weights)
    for name, value in reference.items():
        np.testing.assert_allclose(result[name], value, rtol=1e-5, atol=1e-6)
