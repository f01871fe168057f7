"""EPL's public names and config behaviour (issue 14, item 8), as EPL's docs and tests use them.

epl.Env (FastNN's `Env.get().cluster.total_gpu_num`, `.worker_num`, `Env.get().config`),
epl.get_collection / get_all_collections / GraphKeys.ALL_COLLECTION_KEYS / VERSION,
add_to_collection with a list, epl.Cluster(worker_hosts=...), config attributes set before
epl.init, zero.level "v0", the communication.max_splits default, the dict winning over
EPL_* variables, epl.init under eager execution, and epl.init again with another config.
Each refusal has its exact error.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.errors import ClusterError, ConfigError, ParallelizeError, PassError, ScopeError
from epl.passes.zero import optimizer_state_bytes

from paths import ROOT  # noqa: E402
TIMEOUT = {"communication.collective_timeout_s": 60}


@pytest.fixture(autouse=True)
def fresh_epl(monkeypatch):
    for name in list(os.environ):
        if name.startswith("EPL_"):
            monkeypatch.delenv(name)
    env.reset()
    yield
    env.reset()


# Names ---------------------------------------------------------------------------------

def test_public_names_and_version():
    for name in ("Env", "get_collection", "get_all_collections", "VERSION"):
        assert name in epl.__all__ and hasattr(epl, name)
    assert epl.VERSION == epl.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", epl.__version__)


# epl.Env ---------------------------------------------------------------------------------

def test_env_before_and_after_init():
    environment = epl.Env.get()
    assert environment is epl.Env.get()
    assert environment.config is None and environment.cluster is None
    assert not environment.is_ready
    config = epl.Config({"cluster.virtual_devices": 3, "pipeline.num_micro_batch": 2})
    assert epl.init(config) is config
    assert environment.is_ready
    assert environment.config is config and config.frozen
    assert environment.config.pipeline.num_micro_batch == 2
    cluster = environment.cluster
    # FastNN's reads (moe/trainer.py, resnet/*.py, bert/run_squad.py)
    assert (cluster.worker_num, cluster.worker_index) == (1, 0)
    assert (cluster.gpu_num_per_worker, cluster.total_gpu_num) == (3, 3)
    assert cluster.available_devices == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    assert cluster == epl.Cluster("CPU", 3)


def test_moe_example_of_epl_docs_with_env_cluster():
    """docs/en/api/api_examples.md, MOE Transformer: the device count from epl.Env."""
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True,
                         "cluster.virtual_devices": 2}))
    total_gpu_num = epl.Env.get().cluster.total_gpu_num
    assert total_gpu_num == 2
    with tf.Graph().as_default() as graph:
        epl.set_default_strategy(epl.replicate(total_gpu_num))
        x = tf.compat.v1.placeholder(tf.float32, [4, 8])
        hidden = tf.compat.v1.layers.dense(x, 8)
        with epl.split(total_gpu_num):
            logits = tf.compat.v1.layers.dense(hidden, 6)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.zeros([4], tf.int64), logits=logits))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        result = epl.parallelize(graph)
    assert result.cluster.total_gpu_num == 2


# Collections ------------------------------------------------------------------------------

def test_collections_as_in_epl():
    assert epl.GraphKeys.ALL_COLLECTION_KEYS == [
        epl.GraphKeys.GLOBAL_CONCAT_OBJECTS, epl.GraphKeys.GLOBAL_MEAN_OBJECTS,
        epl.GraphKeys.GLOBAL_SUM_OBJECTS, epl.GraphKeys.LOCAL_CONCAT_OBJECTS,
        epl.GraphKeys.LOCAL_MEAN_OBJECTS, epl.GraphKeys.LOCAL_SUM_OBJECTS]
    with tf.Graph().as_default():
        a, b, c = tf.ones([2]), tf.zeros([2]), tf.constant(3.0)
        epl.add_to_collection([a, b], epl.GraphKeys.GLOBAL_CONCAT_OBJECTS)   # EPL's list form
        epl.add_to_collection(c, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
        epl.add_to_collection((c,), epl.GraphKeys.LOCAL_SUM_OBJECTS)
        assert epl.get_collection(epl.GraphKeys.GLOBAL_CONCAT_OBJECTS) == [a, b]
        assert epl.get_all_collections() == [[a, b], [c], [], [], [], [c]]
    with tf.Graph().as_default():
        assert epl.get_all_collections() == [[]] * 6


def test_collection_errors():
    with tf.Graph().as_default():
        a = tf.ones([2])
        v = tf.compat.v1.get_variable("v", [2], use_resource=True)
        with pytest.raises(ConfigError) as err:
            epl.add_to_collection(a, "global_means")
        assert str(err.value) == (
            "epl.add_to_collection: unknown EPL collection 'global_means'; valid: "
            "global_concat_objects, global_mean_objects, global_sum_objects, "
            "local_concat_objects, local_mean_objects, local_sum_objects (epl.GraphKeys)")
        with pytest.raises(ConfigError, match="^epl.get_collection: unknown EPL collection 'x'"):
            epl.get_collection("x")
        with pytest.raises(ConfigError) as err:
            epl.add_to_collection([a, v], epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
        assert str(err.value) == (
            f"epl.add_to_collection takes tf.Tensor objects (or a list of them); got {v!r} "
            "(ResourceVariable) (for a variable, add its value: tf.identity(v))")
        assert epl.get_collection(epl.GraphKeys.GLOBAL_MEAN_OBJECTS) == []   # nothing added


def test_listed_tensors_are_merged_over_replicas():
    """EPL's collections_test on 2 replicas: add_to_collection([x, labels],
    GLOBAL_CONCAT_OBJECTS) on an iterator's batch; fetching either returns every replica's
    batch in replica order (each replica draws its own), a summed tensor the sum over them."""
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    labels_np = np.arange(8, dtype=np.int64)
    with tf.Graph().as_default():
        dataset = tf.data.Dataset.from_tensor_slices((rows, labels_np)).batch(4)
        x, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        with epl.replicate(device_count=1):
            epl.add_to_collection([x, labels], epl.GraphKeys.GLOBAL_CONCAT_OBJECTS)
            w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 1]))
            summed = tf.reduce_sum(x)
            epl.add_to_collection(summed, epl.GraphKeys.GLOBAL_SUM_OBJECTS)
            error = tf.matmul(x, w)[:, 0] - tf.cast(labels, tf.float32)
            loss = tf.reduce_mean(tf.square(error))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _, got_x, got_labels, got_sum = sess.run([train, x, labels, summed])
    np.testing.assert_array_equal(got_x, rows)
    np.testing.assert_array_equal(got_labels, labels_np)
    assert got_sum == rows.sum()


# epl.Cluster ------------------------------------------------------------------------------

def test_cluster_with_worker_hosts_as_in_epl_tests():
    """EPL's collections_test: `with epl.Cluster(worker_hosts="127.0.0.1:8001",
    worker_index=0):` on one worker."""
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with epl.Cluster(worker_hosts="127.0.0.1:8001", worker_index=0) as cluster:
        assert epl.Env.get().cluster is cluster
        assert cluster.hosts == ("127.0.0.1:8001",)
        assert (cluster.worker_num, cluster.worker_index, cluster.total_gpu_num) == (1, 0, 2)
    assert epl.Env.get().cluster is cluster   # kept after the block, as in EPL
    assert cluster == epl.Cluster()
    epl.init(epl.Config({"cluster.virtual_devices": 3}))
    assert epl.Env.get().cluster.total_gpu_num == 3   # epl.init starts over


def test_cluster_before_init_uses_the_defaults():
    with epl.Cluster(worker_hosts="localhost:1", layout="auto") as cluster:
        assert (cluster.device_type, cluster.num_local_devices) == ("CPU", 4)
    assert not env.is_initialized()   # entering a cluster does not initialize EPL
    assert epl.Env.get().cluster is cluster
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    assert epl.Env.get().cluster.num_local_devices == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(worker_hosts="127.0.0.1:8001,127.0.0.1:8002", worker_index=1),
     "Cluster(worker_hosts=...) lists 2 worker(s) and says this is worker 1, but this process "
     "was not launched by horovodrun or epl-launch (1 worker). EPL's workers are Horovod's: "
     "start the job with `epl-launch -np 2 -H <host:slots,...> python script.py` (or "
     "horovodrun), which sets the worker count and each worker's index; the ports in "
     "worker_hosts are not used."),
    (dict(worker_hosts="a:1", ps_hosts="b:1", job_name="ps", worker_index=0),
     "Cluster(worker_hosts=...) lists 2 worker(s) and says this is worker 1, but this process "
     "was not launched"),
    (dict(worker_hosts="a:1,,b:1"),
     "Cluster(worker_hosts='a:1,,b:1') has an empty host entry; write 'host1:port,host2:port'."),
    (dict(worker_hosts="a:1", worker_index=1),
     "Cluster(worker_index=1) is not a position in the 1 hosts given (0 to 0)."),
    (dict(worker_hosts="a:1", worker_index="0"),
     "Cluster(worker_index='0'): give the index as an int."),
    (dict(ps_hosts="b:1"),
     "Cluster: ps_hosts, job_name and worker_index describe the worker_hosts list; give "
     "worker_hosts='host1:port,...' too."),
    (dict(worker_hosts="a:1", job_name="chief"),
     "Cluster(job_name='chief'): the job is 'worker' (or 'ps', whose hosts EPL counts as "
     "workers)."),
    (dict(worker_hosts="a:1", layout={"specific": [[["/gpu:0"]]]}),
     "Cluster(layout={'specific': [[['/gpu:0']]]}): EPL's planner places the TaskGraphs on "
     "devices; only EPL's automatic layouts are accepted ('all', 'auto' or None)."),
])
def test_cluster_refusals(kwargs, message):
    with pytest.raises(ClusterError) as err:
        epl.Cluster(**kwargs)
    assert str(err.value).startswith(message)


def test_cluster_positional_forms():
    with pytest.raises(ClusterError) as err:
        epl.Cluster("127.0.0.1:8001")
    assert str(err.value) == (
        "Cluster('127.0.0.1:8001', ...): the first argument is the device type, 'CPU' or 'GPU'; "
        "for EPL's list of workers write epl.Cluster(worker_hosts='host1:port,host2:port', "
        "worker_index=i).")
    with pytest.raises(ClusterError, match=r"^Cluster: give either a device type and count or "):
        epl.Cluster("CPU", 2, worker_hosts="a:1")
    with pytest.raises(ClusterError, match=r"^Cluster\('CPU'\): give the number of local"):
        epl.Cluster("CPU")


# epl.init: config freezing, precedence, eager, re-init -------------------------------------

def test_config_set_as_attributes_then_frozen_by_init():
    """EPL's zero_test / optimizer_helper_test: attributes set between Config() and init."""
    config = epl.Config()
    config.zero.level = "v1"
    config.optimizer.num_apply_group = 5
    epl.init(config)
    assert epl.Env.get().config.zero.level == "v1"
    assert epl.Env.get().config.optimizer.num_apply_group == 5
    with pytest.raises(ConfigError) as err:
        config.zero.level = ""
    assert str(err.value).startswith("Cannot set zero.level = '': this Config is in use by "
                                     "epl.init, which froze it")
    assert epl.init({"zero.level": "v1", "optimizer.num_apply_group": 5}) is config  # equal


def test_dict_wins_over_environment_in_init(monkeypatch):
    monkeypatch.setenv("EPL_CLUSTER_VIRTUAL_DEVICES", "3")
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    assert epl.Env.get().cluster.gpu_num_per_worker == 2
    epl.init(epl.Config())
    assert epl.Env.get().cluster.gpu_num_per_worker == 3


def test_init_under_eager_execution_is_accepted_and_empty_eager_scopes_are_refused():
    """A deliberate difference (docs/differences-from-epl.md): EPL's init raised in eager
    mode; here eager programs are parallelized (tf.function steps, Keras fit), and an
    eager scope around nothing EPL can parallelize is refused."""
    assert tf.executing_eagerly()
    config = epl.init()
    assert epl.Env.get().config is config
    with pytest.raises(ScopeError) as err:
        with epl.replicate(1, name="body"):
            pass
    assert str(err.value) == (
        "epl.replicate(device_count=1, name='body') was used in eager mode around code that "
        "built nothing EPL can parallelize (no Keras layer was constructed inside it and no "
        "tf.function was traced). In eager TensorFlow 2, EPL parallelizes tf.function training "
        "steps: open the scope inside the tf.function (around the ops it annotates), or around "
        "the construction of the Keras layers the function calls (each layer re-enters its "
        "scope when it is called in the trace); or build a graph-mode program "
        "(tf.compat.v1.disable_eager_execution()).")


def _annotated_graph():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        with epl.replicate(device_count=1):
            w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 1]))
            loss = tf.reduce_mean(tf.matmul(x, w))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return graph


def test_init_again_with_another_config():
    """EPL's tests call epl.init between graphs; a new config applies to graphs built
    after it, and a graph annotated under an earlier one is refused."""
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    done, pending = _annotated_graph(), _annotated_graph()
    assert epl.parallelize(done).plan.num_replicas == 2
    epl.init(epl.Config({"cluster.virtual_devices": 3, "pipeline.num_micro_batch": 1}))
    assert epl.parallelize(_annotated_graph()).plan.num_replicas == 3
    assert epl.parallelize(done).plan.num_replicas == 2   # parallelized before: kept
    with pytest.raises(ParallelizeError) as err:
        epl.parallelize(pending)
    assert str(err.value) == (
        "this graph was built under an earlier epl.init config, and epl.init was called again "
        "since with a different one (keys that differ: cluster.virtual_devices). EPL rewrites "
        "a graph under the config it was built with: create the graph's session (or call "
        "epl.parallelize) before calling epl.init again, or build the graph after the epl.init "
        "whose config it should use.")
    epl.init(epl.Config({"cluster.virtual_devices": 2}))   # back to its config: fine
    assert epl.parallelize(pending).plan.num_replicas == 2


def test_reinit_between_trainings_as_in_epl_tests(models):
    """EPL's optimizer_helper_test: Config(); attributes; init; train; again with another."""
    reference = models.single_device(model="mlp", optimizer="adam")
    for groups, devices in ((3, 2), (1, 4)):
        config = epl.Config()
        config.optimizer.num_apply_group = groups
        config.cluster.virtual_devices = devices
        epl.init(config)
        models.assert_same_training(models.train(model="mlp", optimizer="adam"), reference)


# zero.level "v0", communication.max_splits ------------------------------------------------

def test_zero_v0_runs_the_v1_sharding(models):
    reference = models.single_device(model="mlp", optimizer="adam")
    config = epl.Config({**TIMEOUT, "cluster.virtual_devices": 2})
    config.zero.level = "v0"   # EPL's zero_test
    epl.init(config)
    models.assert_same_training(models.train(model="mlp", optimizer="adam"), reference)
    states = {}
    for level in ("v0", "v1"):
        epl.init(epl.Config({"cluster.virtual_devices": 2, "zero.level": level}))
        with tf.Graph().as_default() as graph:
            built = models.build("mlp", "adam")
            epl.parallelize(graph)
            states[level] = optimizer_state_bytes(graph, [built.train_op])
    params = sum(v.size for v in models.make_params("mlp").values())
    assert states["v0"] == states["v1"] == {f"/device:CPU:{k}": 4 * params for k in range(2)}


def test_zero_v0_errors_name_v0():
    epl.init(epl.Config({"cluster.virtual_devices": 2, "zero.level": "v0"}))
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 1]), use_resource=False)
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(tf.reduce_mean(tf.matmul(x, w)))
        with pytest.raises(PassError) as err:
            epl.parallelize(graph)
    assert str(err.value).startswith(
        "pass 'zero' rejected the graph before any rewrite: zero.level 'v0' needs resource "
        "variables, but w is a reference variable (VariableV2).")


def _collective_count(models, config):
    epl.init(epl.Config({"cluster.virtual_devices": 2,
                         "communication.local_reduction": "collective", **config}))
    with tf.Graph().as_default() as graph:
        models.build("mlp", "sgd")
        epl.parallelize(graph)
    return len([op for op in graph.get_operations() if op.type == "CollectiveReduce"])


def test_max_splits_default_caps_fusion_buckets_at_five(models):
    """EPL's default communication.max_splits of 5: with a one-byte fusion threshold the
    MLP's six gradients (1808 bytes) go into at most 5 buckets per replica: the cap raises
    the threshold to 1808 / 5 bytes, and filling from the last layer gives [b3 w3 b2] [w2]
    [b1] [w1]. With max_splits 0 (no cap) every gradient is its own bucket."""
    assert epl.Config().communication.max_splits == 5
    tiny = {"communication.fusion_threshold_mb": 1e-6}
    assert _collective_count(models, tiny) == 2 * 4
    assert _collective_count(models, {**tiny, "communication.max_splits": 0}) == 2 * 6


def test_sessions_of_a_rewritten_graph_run_one_round_of_grappler_unless_asked():
    """A rewritten graph's session config asks Grappler for one round of its optimizers
    (epl.parallel.ParallelizeResult.session_config), keeps a number the script set, and
    keeps the script's other settings."""
    from tensorflow.core.protobuf import rewriter_config_pb2
    rounds = rewriter_config_pb2.RewriterConfig
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    result = epl.parallelize(_annotated_graph())
    config = result.session_config(None)
    assert config.graph_options.rewrite_options.meta_optimizer_iterations == rounds.ONE
    assert config.device_count["CPU"] == 2
    base = tf.compat.v1.ConfigProto(allow_soft_placement=True)
    base.graph_options.rewrite_options.meta_optimizer_iterations = rounds.TWO
    config = result.session_config(base)
    assert config.graph_options.rewrite_options.meta_optimizer_iterations == rounds.TWO
    assert config.allow_soft_placement
    assert base.device_count.get("CPU", 1) == 1   # the script's config is not changed
