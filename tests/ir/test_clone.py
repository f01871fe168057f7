"""epl.ir.clone: copies added through one graph import behave like op-by-op copies."""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from epl.ir.clone import NodeBatch, clone_ops


def _model(graph):
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        w = tf.compat.v1.get_variable("w", initializer=np.arange(6, dtype=np.float32).reshape(3, 2))
        start = len(graph.get_operations())
        with tf.compat.v1.colocate_with(w.op):
            h = tf.matmul(x, w, name="h")
        total = tf.reduce_sum(tf.nn.relu(h))
        with tf.control_dependencies([h.op]):
            out = tf.identity(total, name="out")
    return x, w, h, out, graph.get_operations()[start:]


def test_clone_ops_remaps_inputs_controls_devices_and_attrs():
    graph = tf.Graph()
    x, w, h, out, ops = _model(graph)
    with graph.as_default():
        x2 = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x2")
    marker = {"_epl_test": tf.compat.v1.AttrValue(i=7)}
    copies = clone_ops(ops, "COPY", lambda op: "/device:CPU:1", {x: x2}, marker)
    assert set(copies) == set(ops)
    for op, new in copies.items():
        assert new.name == f"COPY/{op.name}"
        assert new.type == op.type and new.device == "/device:CPU:1"
        assert new.get_attr("_epl_test") == 7
        assert not [g for g in new.colocation_groups() if g != f"loc:@{new.name}".encode()]
    new_h = copies[h.op]
    assert new_h.inputs[0] is x2  # input_map
    read = h.op.inputs[1].op  # the variable read: copied if made with the model, else shared
    assert new_h.inputs[1].op is copies.get(read, read)
    assert new_h.outputs[0].shape.as_list() == [2, 2]  # shape inference ran on the slice
    new_out = copies[out.op]
    assert out.op.control_inputs == [h.op]
    assert new_out.control_inputs == [copies[h.op]]  # control input inside the batch remapped
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        value = np.ones([2, 3], np.float32)
        got = session.run(new_out.outputs[0], {x2: value})
        want = session.run(out, {x: np.concatenate([value, np.zeros([2, 3], np.float32)])})
    assert np.allclose(got, want)


def test_clone_ops_known_copies_and_name_that_is_a_scope():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.constant(1.0, name="a")
        b = tf.identity(a, name="b")
        tf.constant(0.0, name="COPY/b/inner")  # "COPY/b" is now an existing name scope
        c = tf.add(b, a, name="c")
    first = clone_ops([a.op], "COPY", lambda op: "")
    second = clone_ops([b.op, c.op], "COPY", lambda op: "", known=first)
    assert second[b.op].inputs[0].op is first[a.op]  # known: resolved to the earlier copy
    assert second[c.op].inputs[1].op is first[a.op]
    assert second[b.op].name.startswith("COPY/b")  # renamed only to avoid the scope
    with tf.compat.v1.Session(graph=graph) as session:
        assert session.run(second[c.op].outputs[0]) == 2.0


def test_node_batch_maps_existing_tensors_and_ops():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.constant([1.0, 2.0], name="a")
        marker = tf.no_op(name="marker")
    batch = NodeBatch(graph)
    node = node_def_pb2.NodeDef(name=batch.new_name("double"), op="Mul",
                                input=[batch.ref(a), batch.ref(a), batch.control_ref(marker)])
    node.attr["T"].type = tf.float32.as_datatype_enum
    batch.add(node)
    op = batch.commit()["double"]
    assert op.inputs[0] is a and op.control_inputs == [marker]
    with tf.compat.v1.Session(graph=graph) as session:
        assert session.run(op.outputs[0]).tolist() == [1.0, 4.0]


def test_a_constant_pool_gives_each_replica_and_device_one_copy_of_a_constant():
    """Copies sharing a ConstantPool read one copy of a constant per (template, device,
    replica attribute), within one import and across imports; a constant with a
    control input (as inside TF1 control flow) is copied for each unit."""
    from epl.ir.clone import ConstantPool, OpCopier
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        scale = tf.constant(2.0, name="scale")
        with tf.control_dependencies([x.op]):
            gated = tf.constant(3.0, name="gated")
        y = tf.identity(x * scale + gated, name="y")
    ops = [scale.op, gated.op, y.op.inputs[0].op.inputs[0].op, y.op.inputs[0].op, y.op]
    replica = lambda k: {"_epl_replica": tf.compat.v1.AttrValue(i=k)}  # noqa: E731
    pool = ConstantPool("_epl_replica")

    def copy(batch, prefix, device, k):
        copier = OpCopier(graph, prefix, lambda op: device, {}, replica(k), batch=batch,
                          constants=pool)
        for op in ops:
            copier.copy(op)
        copier.close()
        return copier

    batch = NodeBatch(graph)
    first = [copy(batch, f"U{m}", "/device:CPU:0", 0) for m in range(2)]
    other_device = copy(batch, "D1", "/device:CPU:1", 0)
    other_replica = copy(batch, "R1", "/device:CPU:0", 1)
    created = batch.commit()
    later_batch = NodeBatch(graph)
    later = copy(later_batch, "U2", "/device:CPU:0", 0)
    later_created = later_batch.commit()

    maps = [c.result(created) for c in first + [other_device, other_replica]]
    maps.append(later.result(later_created))
    shared = maps[0][scale.op]
    assert shared.name == "U0/scale"
    assert maps[1][scale.op] is shared and maps[4][scale.op] is shared
    assert maps[2][scale.op] is not shared and maps[3][scale.op] is not shared
    assert len({m[gated.op] for m in maps}) == 5   # gated: one copy per unit
    assert first[1].shared() == {scale.op} and later.shared() == {scale.op}
    assert first[0].shared() == set()
    mul = y.op.inputs[0].op.inputs[0].op
    assert maps[4][mul].inputs[1].op is shared and maps[1][mul].inputs[1].op is shared
    with tf.compat.v1.Session(graph=graph) as session:
        values = session.run([m[y.op].outputs[0] for m in maps], {x: np.ones([4, 3])})
    for value in values:
        np.testing.assert_array_equal(value, np.full([4, 3], 5.0, np.float32))
