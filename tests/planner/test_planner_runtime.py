"""The runtime Plan follows the local ClusterPlan (epl.planner.local, plan.py):
mixed virtual CPU devices, one search for the dry run and the real run."""
from __future__ import annotations

import pytest
import tensorflow as tf

import epl
from epl.runtime.cluster import Cluster
from epl.ir.graph_view import analyze
from epl.hooks.record import record_of
from epl.planner import local
from epl.planner.plan import make_local_plan, make_plan

# CPU:0 and CPU:3 stand for T4s (16 GB); CPU:1 for a V100-32GB; CPU:2 for a
# V100-32GB with a tenth of its FLOP/s and bandwidth: the same memory as
# CPU:1, so only speed orders them (the search's tie-break).
PROFILES = {"CPU:0": "T4", "CPU:1": "V100-32GB",
            "CPU:2": {"base": "V100-32GB", "memory_bandwidth": 9e10,
                      "peak_flops": {"float32": 1.57e12, "float16": 1.25e13,
                                     "bfloat16": 1.25e13}},
            "CPU:3": "T4"}


def _pipeline_view(batch=64, width=256):
    """A two-stage EPL graph (stage_0, stage_1) on 4 virtual devices."""
    epl.init(epl.Config({"cluster.virtual_devices": 4}))
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, width])
        y = tf.compat.v1.placeholder(tf.int64, [batch])
        with epl.replicate(device_count=1, name="stage_0"):
            w1 = tf.compat.v1.get_variable("w1", [width, width])
            hidden = tf.nn.relu(tf.matmul(x, w1))
        with epl.replicate(device_count=1, name="stage_1"):
            w2 = tf.compat.v1.get_variable("w2", [width, 4])
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(hidden, w2)))
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
    return analyze(graph, record_of(graph))


def _config(**more):
    return epl.Config({"cluster.virtual_devices": 4,
                       "cluster.device_profiles": PROFILES,
                       "pipeline.num_micro_batch": 4, **more})


def test_mixed_pipeline_runs_the_layout_the_dry_run_reports():
    view = _pipeline_view()
    cluster, config = Cluster("CPU", 4), _config()
    layout = local.local_layout(view, cluster, config)
    alt = layout.alternative
    assert alt.name == "pipeline, 2 stages"
    # the dry run: which device runs which stage of which pipeline, and its batch
    expected = {}
    for load in alt.loads:
        expected.setdefault(load.pipeline, {})[load.stage] = load.device.index
    plan = make_local_plan(view.taskgraphs, view, cluster, config)
    for r in range(plan.num_replicas):
        for s, name in enumerate(["stage_0", "stage_1"]):
            assert plan.devices[name][r] == f"/device:CPU:{expected[r][s]}"
    batches = {load.pipeline: load.batch for load in alt.loads}
    assert plan.batch_sizes(64) == [batches[r] for r in range(plan.num_replicas)]
    assert list(plan.replica_weights) == pytest.approx(layout.replica_weights)
    # stage 0 goes to the 32 GB devices, the faster one in the first pipeline
    assert [expected[r][0] for r in range(2)] == [1, 2]
    # local_replica_weights (what epl.parallelize passes today) agrees
    assert local.local_replica_weights(view, cluster, config) == \
        pytest.approx(layout.replica_weights)


def test_memory_only_order_would_disagree_with_the_search():
    """Why the runtime takes the ClusterPlan's layout: the old path (each
    replica's own devices by memory, ties by index) pairs other devices."""
    view = _pipeline_view()
    cluster = Cluster("CPU", 4)
    config = epl.Config({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 4,
                         "cluster.device_profiles": {"CPU:0": "T4", "CPU:1": "T4",
                                                     "CPU:2": "V100-32GB",
                                                     "CPU:3": "V100-32GB"}})
    profiles = local.local_profiles(cluster, config)
    old = make_plan(view.taskgraphs, cluster, None, True,
                    [p.memory_bytes for p in profiles])
    new = make_local_plan(view.taskgraphs, view, cluster, config)
    assert old.devices == {"stage_0": ["/device:CPU:0", "/device:CPU:2"],
                           "stage_1": ["/device:CPU:1", "/device:CPU:3"]}
    # the search: stage 0 on the two 32 GB devices, each pipeline one of each
    assert new.devices == {"stage_0": ["/device:CPU:2", "/device:CPU:3"],
                           "stage_1": ["/device:CPU:0", "/device:CPU:1"]}


def test_data_parallel_shares_come_from_the_cluster_plan():
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [12, 16])
        with epl.replicate(device_count=1, name="body"):
            w = tf.compat.v1.get_variable("w", [16, 4])
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    view = analyze(graph, record_of(graph))
    cluster = Cluster("CPU", 2)
    config = epl.Config({"cluster.virtual_devices": 2, "cluster.device_profiles":
                         {"CPU:0": "V100-32GB", "CPU:1": "T4"}})
    layout = local.local_layout(view, cluster, config)
    assert layout.alternative.name == "data-parallel, balanced by capability"
    sizes = [load.batch for load in layout.alternative.loads]
    plan = make_local_plan(view.taskgraphs, view, cluster, config)
    assert plan.batch_sizes(12) == sizes and sizes[0] > sizes[1]
    even = make_local_plan(view.taskgraphs, view, cluster, config, uneven=False)
    assert even.even


def test_no_profiles_no_layout():
    view = _pipeline_view()
    cluster = Cluster("CPU", 4)
    plain = epl.Config({"cluster.virtual_devices": 4})
    assert local.local_layout(view, cluster, plain) is None
    assert make_local_plan(view.taskgraphs, view, cluster, plain).even


def test_stage_devices_are_checked():
    view = _pipeline_view()
    cluster = Cluster("CPU", 4)
    with pytest.raises(Exception, match="stage_devices=.*distinct local device"):
        make_plan(view.taskgraphs, cluster, stage_devices=[[0, 0], [1, 2]])
