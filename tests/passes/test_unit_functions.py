"""The unit_functions pass: each unit's stage work as one call of a shared function.

- The oracle: training with the pass gives, bit for bit, the variables and losses
  of training without it (`pipeline.unit_functions` off: the copies run; on
  is the default), for the pipelined encoder of test_pipeline.py (stages, micro-
  batches, both schedules, Adam) and for a data-parallel TF1 model with dropout
  (a stateful random op, which stays outside the functions).
- The structure: the training step runs one call per (unit, stage, phase), the
  micro-batches of a stage share their functions, and of the copies the calls
  replaced it runs only the first unit's variable reads, before the updates (a
  fetch of the first unit's copies reads what the calls read).
- Feeds: a forward tensor computed from constants alone stays outside the
  functions, so a feed of it reaches every unit; a feed of a tensor a function
  computes is refused, naming the tensor.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.errors import ParallelizeError
from epl.hooks.session import parallel_graph
from epl.ir.annotations import (EPL_ATTRS, MICRO_BATCH_ATTR, PHASE_ATTR,
                                 SCHEDULE_EDGE_ATTR, TASKGRAPH_ATTR)
from epl.ir.graph_view import ancestors
from epl.passes import unit_functions
from test_pipeline import train_encoder

ON = {"pipeline.unit_functions": True}
OFF = {"pipeline.unit_functions": False}


def _assert_identical(result, reference):
    assert sorted(result.variables) == sorted(reference.variables)
    for name, value in reference.variables.items():
        np.testing.assert_array_equal(result.variables[name], value, err_msg=name)
    assert result.losses == reference.losses


@pytest.mark.parametrize("stages,micro,strategy", [(2, 4, "PreferBackward"),
                                                   (4, 2, "PreferForward")])
def test_calls_train_exactly_as_the_copies(epl_env, stages, micro, strategy):
    config = {"cluster.virtual_devices": stages, "pipeline.num_micro_batch": micro,
              "pipeline.strategy": strategy, "debug.check_invariants": True}
    epl_env({**config, **OFF})
    copies = train_encoder(layers=stages, stages=stages, optimizer="adam")
    epl_env({**config, **ON})
    calls = train_encoder(layers=stages, stages=stages, optimizer="adam")
    _assert_identical(calls, copies)

    result = parallel_graph(calls.graph)
    graph = calls.graph
    built = [op for op in graph.get_operations() if op.type in unit_functions.CALL_TYPES]
    # one call per (micro-batch, stage, phase)
    assert len(built) == micro * stages * 2
    functions = {op.get_attr("f").name for op in built}
    # the micro-batches share them: per stage one forward function and one backward
    # one whatever M is (each backward call adds its micro-batch's gradients into the
    # sums so far; micro-batch 0's call is given zeros as those)
    per_stage: dict = {}
    for op in built:
        key = (op.get_attr(TASKGRAPH_ATTR).decode(), op.get_attr(PHASE_ATTR).decode())
        per_stage.setdefault(key, set()).add(op.get_attr("f").name)
    assert all(len(names) == 1 for names in per_stage.values()), per_stage
    assert len(per_stage) == 2 * stages
    first_backward = [call for call in built if call.get_attr(PHASE_ATTR) == b"backward"
                      and call.get_attr(MICRO_BATCH_ATTR) == 0]
    zeros = {t.op for call in first_backward for t in call.inputs if t.op.type == "Fill"}
    assert zeros and not zeros & result.outlined
    # made when micro-batch 0's backward starts (after the schedule's edge into it),
    # not held from the start of the step
    for op in zeros:
        edges = [c.get_attr(SCHEDULE_EDGE_ATTR).decode() for c in op.control_inputs
                 if SCHEDULE_EDGE_ATTR in c.node_def.attr]
        assert edges and all(edge.endswith("->B0") for edge in edges), (op.name, edges)
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    assert all(library[name].attr[unit_functions.NOINLINE_ATTR].b for name in functions)
    # a body's node is its op's NodeDef without the graph's placement, EPL's tags and
    # the colocation: the calls of every device share it
    for name in functions:
        for node in library[name].node_def:
            assert not node.device and not node.HasField("experimental_debug_info"), node
            assert not node.HasField("experimental_type"), node
            assert not set(node.attr) & (EPL_ATTRS | {"_class"}), (node.name, list(node.attr))
    # the step runs the calls, none of the copies they replaced but the first unit's
    # variable reads (before the updates: a fetch of its copies reads what the calls read)
    assert not any(op.type in unit_functions.CALL_TYPES for op in copies.graph.get_operations())
    step = ancestors(list(result.view.train_ops))
    assert set(built) <= step
    first = result.replication.units()[0]
    first_copies = set(result.replication.forward_copies[first].values()) | \
        set(result.replication.backward_ops[first])
    assert result.outlined and step & result.outlined
    assert all(op.type == "ReadVariableOp" and op in first_copies
               for op in step & result.outlined)


def _dropout_run(config: dict | None, steps: int = 3, inputs: str = "placeholder"):
    """(losses, variables, function bodies) of a TF1 dense model with dropout on 2
    replicas, fed by placeholders holding both replicas' rows or drawn from a tf.data
    iterator (each replica draws its own batch)."""
    env.reset()
    epl.init(epl.Config(dict(config or {})))
    rng = np.random.RandomState(0)
    data = rng.randn(8, 6).astype(np.float32)
    labels = rng.randint(0, 3, size=[8]).astype(np.int32)
    with tf.Graph().as_default() as graph:
        tf.compat.v1.set_random_seed(7)
        if inputs == "dataset":
            dataset = tf.data.Dataset.from_tensor_slices((data, labels)).batch(4).repeat()
            x, y = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
            feed = {}
        else:
            x = tf.compat.v1.placeholder(tf.float32, [4, 6], name="x")
            y = tf.compat.v1.placeholder(tf.int32, [4], name="y")
            feed = {x: data, y: labels}
        init = tf.compat.v1.constant_initializer
        h = tf.compat.v1.layers.dense(x, 16, activation=tf.nn.relu,
                                      kernel_initializer=init(rng.randn(6, 16) / 3))
        h = tf.compat.v1.layers.dropout(h, rate=0.3, training=True)
        logits = tf.compat.v1.layers.dense(h, 3, kernel_initializer=init(rng.randn(16, 3) / 4))
        loss = tf.reduce_mean(tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits))
        train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([loss, train_op], feed)[0]) for _ in range(steps)]
            values = sess.run(tf.compat.v1.trainable_variables())
        calls = [op for op in graph.get_operations() if op.type in unit_functions.CALL_TYPES]
        library = {f.signature.name: f for f in graph.as_graph_def().library.function}
        bodies = [library[op.get_attr("f").name] for op in calls]
    env.reset()
    return losses, values, bodies


@pytest.mark.parametrize("inputs", ["placeholder", "dataset"])
def test_dropout_stays_outside_and_replicas_train_exactly_as_the_copies(inputs):
    layout = {"cluster.virtual_devices": 2, "debug.check_invariants": True}
    with_calls = _dropout_run({**layout, **ON}, inputs=inputs)
    with_copies = _dropout_run({**layout, **OFF}, inputs=inputs)
    assert with_calls[0] == with_copies[0]
    for a, b in zip(with_calls[1], with_copies[1]):
        np.testing.assert_array_equal(a, b)
    assert len(with_calls[2]) == 4 and not with_copies[2]   # 2 replicas x (forward, backward)
    for body in with_calls[2]:   # no stateful op in a body: the random op stays a copy
        assert "RandomUniform" not in {node.op for node in body.node_def}
    assert any("Mul" in {node.op for node in body.node_def} for body in with_calls[2])


def test_a_feed_of_a_tensor_inside_a_function_is_refused():
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2, **ON}))
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        w = tf.compat.v1.get_variable("w", initializer=np.ones([3, 1], np.float32))
        hidden = tf.identity(tf.matmul(x, w), name="hidden")
        loss = tf.reduce_mean(tf.square(hidden))
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.ones([4, 3], np.float32), hidden: np.zeros([2, 1], np.float32)}
            with pytest.raises(ParallelizeError) as err:
                sess.run(train_op, feed)
            assert str(err.value) == (
                "the feed of hidden:0 cannot reach the training step: EPL computes it inside a "
                "unit function (epl/passes/unit_functions.py: each micro-batch's and replica's "
                "work as one function call), which a feed does not enter. Feed a placeholder "
                "(tf.compat.v1.placeholder or placeholder_with_default) instead of a computed "
                "tensor, or set pipeline.unit_functions to False (the copies run, and a feed "
                "reaches them).")
            sess.run(train_op, {x: np.ones([4, 3], np.float32)})   # a plain step still runs
    env.reset()


def _scaled_run(config: dict) -> list:
    """Losses of two steps of a linear model whose loss is scaled by a fed tensor
    computed from a constant (a scale the script feeds), 2 replicas x 2 micro-batches."""
    env.reset()
    epl.init(epl.Config(config))
    data = np.arange(48, dtype=np.float32).reshape(16, 3) / 10
    with tf.Graph().as_default():
        scale = tf.identity(tf.constant(1.0), name="scale")
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        w = tf.compat.v1.get_variable("w", initializer=np.ones([3, 1], np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w))) * scale
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([loss, train_op], {x: data[i * 8:(i + 1) * 8],
                                                        scale: 0.5})[0]) for i in range(2)]
            losses.append(float(sess.run(w)[0, 0]))
    env.reset()
    return losses


def test_a_fed_tensor_computed_from_constants_reaches_every_unit():
    layout = {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}
    assert _scaled_run({**layout, **ON}) == _scaled_run(layout)


def _first_unit_reads_before_updates(result) -> None:
    """Every read of a variable in the first unit's copies that a call replaced (what
    a fetch of its tensors runs) comes before each update of that variable."""
    replication = result.replication
    first = replication.units()[0]
    copied = list(replication.forward_copies[first].values()) + \
        list(replication.backward_ops.get(first, []))
    reads = [op for op in copied if op in result.outlined and op.type == "ReadVariableOp"]
    assert reads
    updates = [op for op in result.graph.get_operations() if op.type.startswith("ResourceApply")]
    assert updates
    for update in updates:
        before = ancestors([update])
        for read in reads:
            if read.inputs[0].op is update.inputs[0].op:
                assert read in before, (read.name, update.name)


def _two_replica_regression():
    """EPL on 2 devices with unit functions on, and a new graph with the placeholders
    of one replica's 8 rows: (graph, 16 rows, their targets, x, y)."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2, **ON}))
    rng = np.random.RandomState(0)
    data, targets = rng.randn(16, 8).astype(np.float32), rng.randn(16, 1).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 8], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [8, 1], name="y")
    return graph, data, targets, x, y


def test_a_fetched_activation_is_computed_from_the_weights_before_the_update():
    """`sess.run([train_op, activation])` returns the activation computed from the
    weights the step trained on, as single-device TensorFlow does. The activation (a
    dense layer's pre-activation, read by nothing outside its own forward) is no call
    output: the session computes it from the first unit's copies, whose variable reads
    are no longer on the way to the update, so the pass orders them before it. Without
    that order a loaded machine returned, about once in 180 steps, an activation
    computed from the updated weights (and the gradient check compared such a copy)."""
    graph, data, targets, x, y = _two_replica_regression()
    with graph.as_default():
        hidden = x
        for i in range(3):
            hidden = tf.compat.v1.layers.dense(
                hidden, 32, activation=tf.nn.relu, name=f"dense_{i}",
                kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
        pre_activation = graph.get_tensor_by_name("dense_2/BiasAdd:0")
        out = tf.compat.v1.layers.dense(hidden, 1, name="out")
        loss = tf.reduce_mean(tf.square(out - y))
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        weights = tf.compat.v1.trainable_variables()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(20):
                values = sess.run(weights)
                _, got = sess.run([train_op, pre_activation], {x: data, y: targets})
                expected = data[:8]   # replica 0's rows
                for i in range(3):
                    pre = expected @ values[2 * i] + values[2 * i + 1]
                    expected = np.maximum(pre, 0)
                # float32 rounding of these 32-term sums is about 1e-6 relative; a read
                # of the updated weights moved them by up to 0.59 (scratch repro, 180 steps)
                np.testing.assert_allclose(got, pre, rtol=1e-4, atol=1e-5)
        result = parallel_graph(graph)
        copy = result.replication.copy_in(pre_activation, result.replication.units()[0])
        assert copy.op in result.outlined and copy not in result.unit_outputs   # the copies'
        _first_unit_reads_before_updates(result)
    env.reset()


def test_calls_wait_for_a_reference_variable_no_readiness_check_sees(tmp_path):
    """Every call waits for a reference variable's op on its device (ref_scan_marks: it
    spares TensorFlow's XLA pass converting every call's body at each new set of
    fetches). The variable is never read and in no collection: a MonitoredTrainingSession
    (its Scaffold's readiness check, its checkpoint) trains as without it."""
    graph, data, targets, x, y = _two_replica_regression()
    with graph.as_default():
        hidden = tf.compat.v1.layers.dense(x, 16, activation=tf.nn.relu)
        loss = tf.reduce_mean(tf.square(tf.compat.v1.layers.dense(hidden, 1) - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
        losses = []
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=str(tmp_path), save_checkpoint_steps=2,
                hooks=[tf.compat.v1.train.StopAtStepHook(last_step=4)]) as sess:
            while not sess.should_stop():
                losses.append(sess.run([loss, train_op], {x: data, y: targets})[0])
        result = parallel_graph(graph)
        calls = [op for op in graph.get_operations() if op.type in unit_functions.CALL_TYPES]
        assert calls
        for call in calls:
            marks = [c for c in call.control_inputs if c.type == "VariableV2"]
            assert len(marks) == 1 and marks[0].device == call.device, call.name
        marks = {c for call in calls for c in call.control_inputs if c.type == "VariableV2"}
        assert len(marks) == 2 and marks == result.ref_marks   # one per device
        assert not marks & {v.op for v in tf.compat.v1.global_variables()}
        assert not marks & {v.op for v in tf.compat.v1.local_variables()}
        assert result.outlined
    assert len(losses) == 4 and np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert tf.train.latest_checkpoint(str(tmp_path))
    env.reset()


def test_the_first_units_reads_come_before_the_updates_in_a_pipeline(epl_env):
    epl_env({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2, **ON})
    trained = train_encoder(layers=2, stages=2, optimizer="adam", steps=1)
    _first_unit_reads_before_updates(parallel_graph(trained.graph))
