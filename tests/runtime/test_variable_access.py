"""`epl.runtime.variable_access.writes_variable`: reads never count as writes.

The session runs the replica / worker sync only after a run that writes an
original variable; a read counted as a write starts a sync that, with several
workers, only the reading worker joins (rank 0's CheckpointSaverHook reads the
global step through a `cond`).
"""
import tensorflow as tf
from tensorflow.python.training import training_util

from epl.ir.graph_view import ancestors
from epl.runtime.variable_access import writes_variable


def _writers(targets, variable):
    """(op type, writes?) of every op among `targets`' ancestors that takes `variable`'s handle."""
    handle = variable.op.outputs[0]
    return sorted({(op.type, writes_variable(op, k)) for op in ancestors(targets)
                   for k, t in enumerate(op.inputs) if t is handle})


def test_cond_read_of_the_global_step_is_not_a_write():
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        read = training_util._get_or_create_global_step_read()  # what CheckpointSaverHook fetches
        assert _writers([read.op], step) == [("If", False), ("VarIsInitializedOp", False)]


def test_writes_through_ops_and_functions():
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=1.0, use_resource=True)
        assign = v.assign(2.0)
        assert _writers([assign.op], v) == [("AssignVariableOp", True)]
        pred = tf.compat.v1.placeholder(tf.bool, [])
        branch_write = tf.cond(pred, lambda: v.assign_add(1.0), lambda: v.read_value())
        assert ("If", True) in _writers([branch_write.op], v)
        branch_read = tf.cond(pred, lambda: v.read_value() * 2, lambda: v.read_value())
        assert ("If", False) in _writers([branch_read.op], v)

        def body(i):
            with tf.control_dependencies([v.assign_add(1.0)]):
                return i + 1
        loop = tf.while_loop(lambda i: i < 3, body, [0])[0]
        assert any(t.startswith("While") and w for t, w in _writers([loop.op], v))
        read_loop = tf.while_loop(lambda i: i < v.read_value(), lambda i: i + 1.0, [0.0])[0]
        types = _writers([read_loop.op], v)
        assert any(t.startswith("While") for t, _ in types) and not any(w for _, w in types)
        init = tf.compat.v1.global_variables_initializer()
        assert ("AssignVariableOp", True) in _writers([init], v)


def test_reference_variables():
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("r", initializer=1.0, use_resource=False)
        assert _writers([tf.compat.v1.assign(v, 3.0).op], v) == [("Assign", True)]
        assert _writers([tf.identity(v).op], v) == [("Identity", False)]
