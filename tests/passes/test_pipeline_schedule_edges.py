"""Schedules as data, and the control edges the schedule pass lowers them to.

- The tables: for S stages and M micro-batches, 1F1B (PreferBackward) never has
  more than S - s micro-batches in flight on stage s; GPipe (PreferForward)
  has M.
- The rewritten graph: the per-stage order of the (replica, micro-batch)
  copies, read back from the graph alone (op attributes and the barriers'
  control edges), is the table's; all of a step's work precedes the next
  step's; the graph stays acyclic; the dump shows the table and the stage
  boundaries. These read the schedule pass's lowering onto the copies, so they
  run with `pipeline.unit_functions` off (on, the unit_functions pass moves the
  barriers' edges onto the calls that replace the copies).
- At run time, with the copies and with the calls (the default): activations
  cross devices through TensorFlow's send/receive, and each stage really runs
  its steps in the table's order.
"""
from __future__ import annotations

import collections
import json
import os

import pytest
import tensorflow as tf

from epl.ir.annotations import MICRO_BATCH_ATTR, PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR
from epl.ir.graph_view import ancestors
from epl.passes.pipeline.step_order import BACKWARD, FORWARD, Step, make_schedule
from epl.passes.pipeline.schedule import SCHEDULE_EDGE_ATTR
from epl.passes.verify import check_acyclic
from test_pipeline import _parallelize, _session_config
from paths import BENCH  # noqa: E402


# --------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8, 16])
def test_in_flight_bounds(stages, micro):
    one_f_one_b = make_schedule("PreferBackward", stages, micro)
    gpipe = make_schedule("PreferForward", stages, micro)
    for schedule in (one_f_one_b, gpipe):
        assert schedule.is_valid()
    for s in range(stages):
        assert one_f_one_b.max_in_flight(s) <= stages - s
        assert one_f_one_b.max_in_flight(s) == min(stages - s, micro)
        assert gpipe.max_in_flight(s) == micro


# --------------------------------------------------------------------------
# The rewritten graph
# --------------------------------------------------------------------------


def _attr(op, name):
    attr = op.node_def.attr.get(name)
    if attr is None:
        return None
    return attr.s.decode() if attr.WhichOneof("value") == "s" else attr.i


def _step_of(op, stages):
    """(replica, stage, Step) of a micro-batch copy op, from its attributes alone."""
    phase, micro = _attr(op, PHASE_ATTR), _attr(op, MICRO_BATCH_ATTR)
    if phase not in (FORWARD, BACKWARD) or micro is None:
        return None
    stage = stages[_attr(op, TASKGRAPH_ATTR)]
    return _attr(op, REPLICA_ATTR), stage, Step(stage, micro, phase)


def _orders_from_graph(graph, stages):
    """(replica, stage) -> the step order the barriers impose, read from the graph."""
    edges = collections.defaultdict(dict)
    for barrier in graph.get_operations():
        label = _attr(barrier, SCHEDULE_EDGE_ATTR)
        if label is None:
            continue
        before = {_step_of(op, stages) for op in barrier.control_inputs}
        after = {_step_of(op, stages) for op in barrier._control_outputs}
        assert len(before) == 1 and len(after) == 1, barrier.name
        (r, s, a), (r2, s2, b) = before.pop(), after.pop()
        assert (r, s) == (r2, s2) == (_attr(barrier, REPLICA_ATTR), stages[_attr(barrier, TASKGRAPH_ATTR)])
        assert label == f"{a}->{b}"
        assert a not in edges[(r, s)]
        edges[(r, s)][a] = b
    orders = {}
    for key, successor in edges.items():
        first = (set(successor) - set(successor.values())).pop()
        order = [first]
        while order[-1] in successor:
            order.append(successor[order[-1]])
        orders[key] = order
    return orders


CASES = [
    pytest.param(2, 4, "PreferBackward", 2, id="2stages-4mb-1F1B"),
    pytest.param(2, 4, "PreferForward", 2, id="2stages-4mb-GPipe"),
    pytest.param(4, 4, "PreferBackward", 4, id="4stages-4mb-1F1B"),
    pytest.param(4, 2, "PreferForward", 4, id="4stages-2mb-GPipe"),
    pytest.param(2, 2, "PreferBackward", 4, id="2stages-2mb-1F1B-2replicas"),
    pytest.param(1, 3, "PreferForward", 2, id="accumulation-3mb-GPipe-2replicas"),
]


@pytest.mark.parametrize("stages,micro,strategy,devices", CASES)
def test_control_edges_follow_the_table(stages, micro, strategy, devices):
    graph, built, result = _parallelize(
        {"cluster.virtual_devices": devices, "pipeline.num_micro_batch": micro,
         "pipeline.strategy": strategy, "pipeline.unit_functions": False},
        layers=max(stages, 2), stages=stages, batch=12)
    replicas = result.plan.num_replicas
    assert replicas == devices // stages
    index = {tg.name: tg.index for tg in result.view.taskgraphs}
    orders = _orders_from_graph(graph, index)
    table = make_schedule(strategy, stages, micro)
    assert set(orders) == {(r, s) for r in range(replicas) for s in range(stages)}
    for (r, s), order in orders.items():
        assert tuple(order) == table.per_stage[s], (r, s)
        in_flight = peak = 0
        for step in order:
            in_flight += 1 if step.kind == FORWARD else -1
            peak = max(peak, in_flight)
        assert peak == (min(stages - s, micro) if strategy == "PreferBackward" else micro)
    check_acyclic(graph)

    # All of step A's training work precedes all of step B's (constants compute
    # nothing: they take no part in the order, and micro-batches share them).
    live = ancestors([built.train_op])
    steps = collections.defaultdict(list)
    for op in live:
        if op.type == "Const" and not op.inputs and not op.control_inputs:
            continue
        key = _step_of(op, index)
        if key is not None:
            steps[key].append(op)
    for barrier in graph.get_operations():
        if _attr(barrier, SCHEDULE_EDGE_ATTR) is None:
            continue
        (r, s, a), = {_step_of(op, index) for op in barrier.control_inputs}
        (_, _, b), = {_step_of(op, index) for op in barrier._control_outputs}
        before = ancestors([barrier])
        assert set(steps[(r, s, a)]) <= before, barrier.name
        assert not set(steps[(r, s, b)]) & before
        for op in steps[(r, s, b)]:
            assert barrier in ancestors([op]) or op not in live


def test_no_edges_for_plain_data_parallelism():
    graph, _, _ = _parallelize({"cluster.virtual_devices": 2}, layers=2)
    assert not [op for op in graph.get_operations() if _attr(op, SCHEDULE_EDGE_ATTR)]


def test_dump_shows_table_boundaries_and_edges(tmp_path):
    dump_dir = str(tmp_path / "dump")
    graph, _, _ = _parallelize({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
                                "debug.dump_dir": dump_dir}, layers=2, stages=2)
    names = sorted(os.listdir(dump_dir))
    # the schedule pass's dump, whatever passes run before it
    [stem] = [name[:-len(".json")] for name in names if name.endswith("_schedule.json")]
    assert stem + ".pb" in names
    with open(os.path.join(dump_dir, stem + ".json")) as f:
        summary = json.load(f)
    notes = summary["notes"]
    assert notes[0] == ("PreferBackward: 2 stage(s) x 2 micro-batch(es), 6 schedule edges "
                        "over 1 replica(s)")
    assert notes[1:3] == ["stage 0: F0 F1 B0 B1", "stage 1: F0 B0 F1 B1"]
    assert notes[3].startswith("stage boundary 0->1: 1 tensor(s) (EPL_REPLICA_0/EPL_MICRO_BATCH_0/")
    barriers = [name for name in summary["added"] if name.startswith("EPL_SCHEDULE/")]
    assert len(barriers) == 6
    from epl.observability.dump_format import load_graph_def
    graph_def = load_graph_def(os.path.join(dump_dir, stem + ".pb"))
    assert "EPL_SCHEDULE/replica_0/stage_1/B0_to_F1" in {node.name for node in graph_def.node}
    assert "^EPL_SCHEDULE/replica_0/stage_1/B0_to_F1" in {  # a control input in the dump
        name for node in graph_def.node for name in node.input}


def _run_one_step(graph, built):
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                      output_partition_graphs=True)
    metadata = tf.compat.v1.RunMetadata()
    with graph.as_default(), tf.compat.v1.Session(config=_session_config()) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(built.train_op, built.feed, options=options, run_metadata=metadata)
    return metadata


@pytest.mark.parametrize("unit_functions", [False, True], ids=["copies", "calls"])
def test_send_receive_and_run_time_order(unit_functions):
    """Stage boundaries are TensorFlow _Send/_Recv pairs (every micro-batch's forward
    on stage 0 sends to stage 1), and the executor runs each stage's steps in the
    table's order (from the step's timeline: the copies' ops, or the calls)."""
    graph, built, result = _parallelize({"cluster.virtual_devices": 2,
                                         "pipeline.num_micro_batch": 4,
                                         "pipeline.unit_functions": unit_functions},
                                        layers=2, stages=2)
    metadata = _run_one_step(graph, built)
    index = {tg.name: tg.index for tg in result.view.taskgraphs}
    sent = set()
    for partition in metadata.partition_graphs:
        for node in partition.node:
            if node.op == "_Recv" and node.attr["send_device"].s.decode().endswith("CPU:0") \
                    and node.attr["recv_device"].s.decode().endswith("CPU:1"):
                # tensor_name: edge_<n>_<the sending op's name>
                name = node.attr["tensor_name"].s.decode().split("_", 2)[2]
                try:
                    sent.add(_step_of(graph.get_operation_by_name(name), index))
                except KeyError:
                    continue
    for m in range(4):
        assert (0, 0, Step(0, m, FORWARD)) in sent, m
    if unit_functions:
        assert any(op.type in ("PartitionedCall", "StatefulPartitionedCall")
                   for op in graph.get_operations())
    spans = {}
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            try:
                op = graph.get_operation_by_name(node.node_name)
            except KeyError:
                continue
            key = _step_of(op, index)
            if key is None or (op.type == "Const" and not op.inputs):  # constants: no order
                continue
            start = node.all_start_micros
            end = start + max(node.all_end_rel_micros, 1)
            low, high = spans.get(key, (start, end))
            spans[key] = (min(low, start), max(high, end))
    table = make_schedule("PreferBackward", 2, 4)
    for s, row in enumerate(table.per_stage):
        for a, b in zip(row, row[1:]):
            assert spans[(0, s, a)][1] <= spans[(0, s, b)][0], (s, a, b)


def test_bench_quick_prints_memory_and_bubble_lines(capsys):
    import os
    import re
    import sys
    sys.path.insert(0, BENCH)
    import pipeline as bench_pipeline
    results = bench_pipeline.main(["--quick"])
    out = capsys.readouterr().out
    assert re.search(r"^pipeline: peak memory 1F1B / GPipe at M=4 = \d+\.\d\d \(stage 0\), "
                     r"\d+\.\d\d \(stage 1\); growth M=2->4: 1F1B ", out, re.M), out
    assert re.search(r"^pipeline: bubble .*M=4: GPipe \d\.\d{3}, 1F1B \d\.\d{3}, ideal 0\.200$",
                     out, re.M), out
    assert set(results) == {(m, s) for m in (2, 4) for s in ("PreferForward", "PreferBackward")}
    for result in results.values():
        assert all(peak > 0 for peak in result["peak"])
        assert all(0 <= idle < 1 for idle in result["idle"])
    # Already at this size: GPipe holds more than 1F1B at M=4 and grows faster with M.
    gpipe = [results[(m, "PreferForward")]["peak"] for m in (2, 4)]
    one_f_one_b = [results[(m, "PreferBackward")]["peak"] for m in (2, 4)]
    for s in range(2):
        assert one_f_one_b[1][s] < gpipe[1][s]
        assert gpipe[1][s] / gpipe[0][s] > one_f_one_b[1][s] / one_f_one_b[0][s]
