"""The dumps of debug.dump_dir (epl/observability/dump_writer.py): re-serializing only the
ops a pass created or changed gives, after every pass, the graph `as_graph_def` gives.

Each test parallelizes a real model with dumps on, and compares every dumped pass's
graph with the full `as_graph_def(add_shapes=True)` (large constants elided) taken at the
same moment: node by node (a GraphDef's node order carries no meaning, nor the order of
an op's control inputs), and the library (as_graph_def()'s, without add_shapes' attributes,
unless the graph is dumped whole).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import tensorflow as tf

import epl
import epl.layers as layers
from epl.observability import dump_writer
from epl.observability.dump_format import load_graph_def, read_dump


def _nodes(graph_def) -> dict:
    """name -> NodeDef with its control inputs sorted and ":0" dropped from input names
    (TensorFlow's GraphDef writes them so; an op's own NodeDef keeps its control inputs
    in the order they were added, and "x:0" for an input rewired to x: the same graph),
    without TensorFlow's bookkeeping attribute `_has_manual_control_dependencies`
    (dump_writer's module doc)."""
    nodes = {}
    for node in graph_def.node:
        if "_has_manual_control_dependencies" in node.attr:
            del node.attr["_has_manual_control_dependencies"]
        data = [name[:-2] if name.endswith(":0") else name
                for name in node.input if not name.startswith("^")]
        control = sorted(name for name in node.input if name.startswith("^"))
        del node.input[:]
        node.input.extend(data + control)
        nodes[node.name] = node
    return nodes


@pytest.fixture()
def compared(monkeypatch):
    """Wrap GraphSerializer.serialize to compare each result with the full graph; returns
    the list of (whole serialization?, op count) of the calls."""
    calls = []
    real = dump_writer.GraphSerializer.serialize

    def serialize(self):
        data, count = real(self)
        expected = dump_writer._full_graph_def(self.graph)
        was_none = data is None
        if was_none:
            data = self._last
        got = tf.compat.v1.GraphDef.FromString(data)
        assert _nodes(got) == _nodes(expected)
        library = expected.library if self._whole else self.graph.as_graph_def().library
        for function in library.function:
            for node in function.node_def:
                dump_writer.elide_node_constants(node)
        assert got.library == library and got.versions == expected.versions
        assert count == len(expected.node)
        self._last = data
        calls.append((self._whole, count))
        return (None if data is self._last and was_none else data), count

    monkeypatch.setattr(dump_writer.GraphSerializer, "serialize", serialize)
    return calls


def _pipeline(micro_batches: int = 2):
    data = np.random.RandomState(0).rand(256, 8).astype(np.float32)   # a 8 KiB constant
    x = tf.compat.v1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(data).repeat().batch(4)).get_next()
    with epl.replicate(device_count=1, name="stage_0"):
        hidden = tf.nn.relu(tf.compat.v1.layers.dense(x, 16, name="hidden"))
    with epl.replicate(device_count=1, name="stage_1"):
        loss = tf.reduce_mean(tf.compat.v1.layers.dense(hidden, 1, name="out") ** 2)
    step = tf.compat.v1.train.get_or_create_global_step()
    return tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss, step)


def test_pipeline_dumps_equal_the_full_graph_after_every_pass(epl_env, tmp_path, compared,
                                                              caplog):
    dump_dir = str(tmp_path / "dump")
    epl_env({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2,
             "debug.dump_dir": dump_dir})
    with tf.Graph().as_default() as graph, caplog.at_level(logging.DEBUG, logger="epl"):
        _pipeline()
        epl.parallelize(graph)
    dumps = read_dump(dump_dir)
    # re-serialized op by op until the last pass, unit_functions (on by default), adds
    # its PartitionedCalls: from then on the graph is serialized whole (AUTODIFF_REWRITTEN)
    assert len(compared) == len(dumps) and not any(whole for whole, _ in compared[:-1])
    assert compared[-1][0]
    changed = [d.pass_name for d in dumps if not d.unchanged]
    assert changed[:3] == ["input", "annotate", "replicate"] and "schedule" in changed
    assert [d.pass_name for d in dumps if d.unchanged] and changed[-1] == "unit_functions"
    final = load_graph_def(dumps[-1].graph_path)
    assert len(final.node) == len(graph.get_operations())
    elided = [n for n in final.node if "_epl_dump_elided" in n.attr]
    assert [n.attr["_epl_dump_elided"].i >= 8192 for n in elided] == [True]
    messages = [r.getMessage() for r in caplog.records if r.name == "epl.observability.dump_writer"]
    assert messages[0] == (f"writing a graph dump after every pass to {dump_dir} (read it "
                           f"with: epl-dump {dump_dir})")
    assert len(messages) == 1 + len(dumps)   # one INFO, then one DEBUG line per pass
    assert messages[2].startswith(f"dump of pass 1 (auto_stages): {dump_dir}{os.sep}000_input.pb"
                                  " (unchanged)")


def test_split_dumps_at_gradient_and_parallelize_time_equal_the_full_graph(
        epl_env, tmp_path, compared):
    dump_dir = str(tmp_path / "dump")
    epl_env({"cluster.virtual_devices": 2, "cluster.colocate_split_and_replicate": True,
             "debug.dump_dir": dump_dir})
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [4, 6])
        y = tf.compat.v1.placeholder(tf.int64, [4])
        with epl.replicate(device_count=1):
            hidden = layers.dense(x, 8, activation=tf.nn.relu, name="body")
        with epl.split(device_count=2):
            loss = layers.sparse_softmax_cross_entropy(y, layers.dense(hidden, 10, name="cls"))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        epl.parallelize(graph)
    passes = [d.pass_name for d in read_dump(dump_dir)]
    assert passes[:3] == ["input", "split", "gradients"] and len(compared) == len(passes)


def test_v2_control_flow_is_dumped_whole(epl_env, tmp_path, compared):
    epl_env({"cluster.virtual_devices": 2, "debug.dump_dir": str(tmp_path / "dump")})
    tf.compat.v1.enable_control_flow_v2()
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        with epl.replicate(device_count=1):
            w = tf.compat.v1.get_variable("w", [3, 3])
            _, h = tf.compat.v1.while_loop(lambda i, h: i < 2,
                                           lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                                           [tf.constant(0), x])
            loss = tf.reduce_mean(h)
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        epl.parallelize(graph)
    assert compared and all(whole for whole, _ in compared)


@pytest.mark.parametrize("config, passes", [
    ({"amp.level": "O1", "optimizer.num_apply_group": 2, "gradient_checkpoint.type": "auto"},
     {"amp", "apply_groups", "skip_on_overflow", "unscale", "gradient_comm"}),
    ({"zero.level": "v1"}, {"zero"}),
    ({"offload.level": "v0", "pipeline.num_micro_batch": 2},
     {"offload", "accumulate", "gradient_comm"}),
], ids=["amp_groups_recompute", "zero", "offload_accumulation"])
def test_the_other_passes_dump_the_full_graph(epl_env, tmp_path, compared, config, passes):
    epl_env({"cluster.virtual_devices": 2, "debug.dump_dir": str(tmp_path / "dump"), **config})
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.from_tensor_slices(
            np.ones([64, 8], np.float32)).repeat().batch(4)).get_next()
        with epl.replicate(device_count=1):
            h = x
            for i in range(3):
                h = tf.nn.tanh(tf.compat.v1.layers.dense(h, 8, name=f"layer{i}"))
            loss = tf.reduce_mean(h ** 2)
        step = tf.compat.v1.train.get_or_create_global_step()
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss, step)
        epl.parallelize(graph)
    changed = [d.pass_name for d in read_dump(str(tmp_path / "dump")) if not d.unchanged]
    assert len(compared) >= 14
    assert (passes | {"replicate"}) - set(changed) == set(), changed


def test_dump_overhead_bench_prints_its_two_lines(capsys):
    """bench/dump_overhead.py (the figures of issue 28 item 3) with one repeat."""
    import re
    import sys
    from paths import BENCH
    sys.path.insert(0, BENCH)
    import dump_overhead
    assert dump_overhead.main(["--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^dump_overhead: ratio rewrite with dump / without = \d+\.\d\d "
                     r"\(bert_pipeline, CPU time; wall \d+\.\d\d\); target <= 1\.3$", out,
                     re.M), out
    assert re.search(r"^dump_overhead: epl-dump on the train_mlp dump \(\d+\.\d\d MiB\) = "
                     r"\d+\.\d\d s \(median of 1; TensorFlow not imported\); target < 2 s$",
                     out, re.M), out
