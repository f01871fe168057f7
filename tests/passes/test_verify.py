"""The invariant checks of epl/passes/verify.py on small hand-built graphs."""
import pytest
import tensorflow as tf

import epl
from epl.errors import PassError
from epl.passes import verify


def _chain(n):
    """x -> a0 -> a1 -> ... (Identity ops), in creation order."""
    ops = []
    x = tf.constant(1.0, name="x")
    for i in range(n):
        x = tf.identity(x, name=f"a{i}")
        ops.append(x.op)
    return ops


def test_rewired_graph_without_cycle_passes():
    with tf.Graph().as_default() as graph:
        a = _chain(4)
        late = tf.identity(a[1].outputs[0], name="late")  # created last, read by an earlier op
        a[2]._update_input(0, late)                       # a back edge, but no cycle
        with tf.control_dependencies([late.op]):
            tf.no_op(name="after")
        a[3]._add_control_inputs([tf.no_op(name="barrier")])
    verify.check_acyclic(graph)
    verify.check_acyclic(graph, verify.predecessors(graph))


@pytest.mark.parametrize("kind", ["data", "control", "self"])
def test_cycle_names_the_ops_on_and_after_it(kind):
    with tf.Graph().as_default() as graph:
        a = _chain(4)
        if kind == "data":        # a1 reads a2, which reads a1
            a[1]._update_input(0, a[2].outputs[0])
            expected = ["a1", "a2", "a3"]
        elif kind == "control":   # a0 waits for a2, which needs a0
            a[0]._add_control_inputs([a[2]])
            expected = ["a0", "a1", "a2", "a3"]
        else:                     # a2 reads itself
            a[2]._update_input(0, a[2].outputs[0])
            expected = ["a2", "a3"]
    with pytest.raises(PassError, match="the graph has a cycle through these ops") as err:
        verify.check_acyclic(graph)
    listed = str(err.value).split("ops: ", 1)[1].split(". A stage reads", 1)[0]
    assert [part.split(" ")[0] for part in listed.split("; ")] == expected


def test_untagged_or_unplaced_ops_are_named():
    with tf.Graph().as_default() as graph:
        _chain(1)
    with pytest.raises(PassError, match="ops without a TaskGraph or a device") as err:
        verify.check_tagged_and_placed(graph)
    assert "x (type Const" in str(err.value) and "a0 (type Identity" in str(err.value)


def test_predecessors_match_the_graph_api(models, epl_env):
    """The inputs verify reads are the ops' data and control inputs, also after the
    passes rewired them (replicas, fused gradients, schedule edges), whether or not
    TensorFlow has cached an op's inputs."""
    epl_env({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2})
    with tf.Graph().as_default() as graph:
        models.build("mlp", "adam")
        epl.parallelize(graph)
    preds = verify.predecessors(graph)
    assert list(preds) == graph.get_operations()
    for op, producers in preds.items():
        assert producers == [t.op for t in op.inputs] + list(op.control_inputs), op.name
    assert preds == verify.predecessors(graph)  # now with every op's inputs cached
