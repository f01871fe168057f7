"""Tests of the per-pass dump format (`epl.observability.dump_format`) and `epl-dump`."""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.ops import collective_ops

from epl.observability import dump_format
from epl.observability.dump_format import DumpError, load_graph_def, read_dump, write_pass_dump
from epl.tools import dump as epl_dump
from epl.tools.dump import main
from epl.tools.dump_graph import find_collectives

REDUCE_0 = "allreduce_replica_0/CollectiveReduce"
REDUCE_1 = "allreduce_replica_1/CollectiveReduce"


@contextlib.contextmanager
def _epl_scope(graph: tf.Graph, taskgraph: str, phase: str, replica: int | None = None):
    """Tag every op created inside with EPL's node attributes."""
    attrs = {"_epl_taskgraph": tf.compat.v1.AttrValue(s=taskgraph.encode()),
             "_epl_phase": tf.compat.v1.AttrValue(s=phase.encode())}
    if replica is not None:
        attrs["_epl_replica"] = tf.compat.v1.AttrValue(i=replica)
    with graph._attr_scope(attrs):  # pylint: disable=protected-access
        yield


def _build_graphs() -> tuple[graph_pb2.GraphDef, graph_pb2.GraphDef]:
    """Return (input graph, graph with two all-reduces and an apply op).

    The input graph is a matmul model with its gradient; the second graph
    adds an all-reduce of the [4, 3] float32 gradient on CPU:0 (replica 0)
    and CPU:1 (replica 1, through an identity) and a gradient-descent update.
    """
    with tf.Graph().as_default() as graph:
        features = tf.compat.v1.placeholder(tf.float32, [8, 4], name="x")
        with _epl_scope(graph, "stage_0", "forward"):
            weights = tf.compat.v1.get_variable(
                "w", [4, 3], initializer=tf.compat.v1.zeros_initializer())
            logits = tf.matmul(features, weights, name="logits")
            loss = tf.reduce_mean(tf.square(logits), name="loss")
        with _epl_scope(graph, "stage_1", "backward"):
            (grad,) = tf.compat.v1.gradients(loss, [weights])
        input_graph = graph.as_graph_def(add_shapes=True)
        with _epl_scope(graph, "stage_1", "backward", replica=0):
            with tf.device("/device:CPU:0"), tf.name_scope("allreduce_replica_0"):
                reduced = collective_ops.all_reduce(grad, 2, 1, 1, "Add", "Id")
        with _epl_scope(graph, "stage_1", "backward", replica=1):
            with tf.device("/device:CPU:1"), tf.name_scope("allreduce_replica_1"):
                copy = tf.identity(grad, name="grad_copy")
                collective_ops.all_reduce(copy, 2, 1, 1, "Add", "Id")
        with _epl_scope(graph, "stage_1", "apply"):
            weights.assign_sub(reduced * 0.1, name="apply_w", read_value=False)
        return input_graph, graph.as_graph_def(add_shapes=True)


def _pruned(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    """Return a copy without the apply ops and with "logits" moved to CPU:0."""
    pruned = graph_pb2.GraphDef()
    pruned.CopyFrom(graph_def)
    kept = [node for node in pruned.node if node.name not in ("apply_w", "mul", "mul/y")]
    del pruned.node[:]
    pruned.node.extend(kept)
    next(node for node in pruned.node if node.name == "logits").device = "/device:CPU:0"
    return pruned


@pytest.fixture(scope="module")
def graphs() -> tuple[graph_pb2.GraphDef, graph_pb2.GraphDef]:
    """The input graph and the replicated graph, built once."""
    return _build_graphs()


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory, graphs) -> str:
    """A dump of three passes: input, replicate (full summary), prune (no keys)."""
    directory = str(tmp_path_factory.mktemp("dump") / "epl_dump")
    input_graph, replicated = graphs
    write_pass_dump(directory, 0, "input", input_graph, {"duration_s": 0.0})
    added = sorted({n.name for n in replicated.node} - {n.name for n in input_graph.node})
    write_pass_dump(directory, 1, "replicate", replicated, {
        "duration_s": 0.0123, "added": added, "removed": [],
        "op_map": {"logits": ["logits"]}, "passes_before": ["input"]})
    write_pass_dump(directory, 2, "prune", _pruned(replicated), {})
    return directory


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    """Run `epl-dump` and return (exit code, stdout, stderr)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _line_with(text: str, prefix: str, start: str = "") -> str:
    """Return the first line containing `prefix` after the line containing `start`."""
    tail = text[text.index(start):] if start else text
    return next(line for line in tail.splitlines() if prefix in line)


# --------------------------------------------------------------------------
# Writer and reader
# --------------------------------------------------------------------------


def test_writer_creates_graph_summary_and_manifest(dump_dir, graphs):
    names = sorted(os.listdir(dump_dir))
    assert names == ["000_input.json", "000_input.pb", "001_replicate.json",
                     "001_replicate.pb", "002_prune.json", "002_prune.pb",
                     "manifest.json"]
    with open(os.path.join(dump_dir, "manifest.json"), encoding="utf-8") as handle:
        manifest = json.load(handle)
    assert [(e["index"], e["pass"], e["graph"], e["summary"]) for e in manifest["passes"]] == [
        (0, "input", "000_input.pb", "000_input.json"),
        (1, "replicate", "001_replicate.pb", "001_replicate.json"),
        (2, "prune", "002_prune.pb", "002_prune.json")]
    with open(os.path.join(dump_dir, "001_replicate.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    assert summary["index"] == 1 and summary["pass"] == "replicate"
    assert summary["graph"] == "001_replicate.pb"
    assert summary["num_ops"] == len(graphs[1].node)
    assert summary["passes_before"] == ["input"] and summary["duration_s"] == 0.0123


def test_read_dump_round_trips_graphs_and_summaries(dump_dir, graphs):
    dumps = read_dump(dump_dir)
    assert [(d.index, d.pass_name) for d in dumps] == [
        (0, "input"), (1, "replicate"), (2, "prune")]
    assert dumps[0].graph_def == graphs[0] and dumps[1].graph_def == graphs[1]
    assert dumps[1].summary["op_map"] == {"logits": ["logits"]}
    assert dumps[2].summary == {"index": 2, "pass": "prune", "graph": "002_prune.pb",
                                "num_ops": len(graphs[1].node) - 3}


def test_load_graph_def_reads_text_and_binary(tmp_path, graphs):
    binary = tmp_path / "g.pb"
    binary.write_bytes(graphs[0].SerializeToString())
    assert load_graph_def(str(binary)) == graphs[0]
    garbage = tmp_path / "g.pbtxt"
    garbage.write_text("node { this is not a graph")
    with pytest.raises(DumpError, match="cannot parse"):
        load_graph_def(str(garbage))


def test_writer_tolerates_missing_and_non_json_summary_values(tmp_path, graphs):
    directory = str(tmp_path / "d")
    write_pass_dump(directory, 0, "input", graphs[0], None)
    path = write_pass_dump(directory, 1, "odd/name", graphs[1], {
        "removed": {"b", "a"}, "op_map": {"a": ("x", "y")}, "duration_s": np.float32(0.5)})
    assert os.path.basename(path) == "001_odd_name.pb"
    dumps = read_dump(directory)
    assert dumps[1].pass_name == "odd/name"
    assert dumps[1].summary["removed"] == ["a", "b"]
    assert dumps[1].summary["op_map"] == {"a": ["x", "y"]}
    assert dumps[1].summary["duration_s"] == 0.5


def test_rewriting_an_index_replaces_it_and_index_zero_starts_a_new_dump(tmp_path, graphs):
    directory = str(tmp_path / "d")
    for index, name in enumerate(["input", "a", "b"]):
        write_pass_dump(directory, index, name, graphs[0], {})
    write_pass_dump(directory, 1, "a2", graphs[1], {})
    assert [(d.index, d.pass_name) for d in read_dump(directory)] == [
        (0, "input"), (1, "a2"), (2, "b")]
    assert not os.path.exists(os.path.join(directory, "001_a.pb"))
    write_pass_dump(directory, 0, "input", graphs[0], {})
    assert [d.pass_name for d in read_dump(directory)] == ["input"]
    assert sorted(os.listdir(directory)) == ["000_input.json", "000_input.pb",
                                             "manifest.json"]


# --------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------


def test_find_collectives_reads_v1_group_dtype_shape_and_bytes(graphs):
    collectives = find_collectives(graphs[1])
    assert [(c.kind, c.name, c.device) for c in collectives] == [
        ("CollectiveReduce", REDUCE_0, "/device:CPU:0"),
        ("CollectiveReduce", REDUCE_1, "/device:CPU:1")]
    first = collectives[0]
    assert (first.group_key, first.group_size, first.instance_key) == (1, 2, 1)
    assert first.group == "key=1 size=2 instance=1"
    assert (first.dtype, first.shape, first.bytes) == ("float32", [4, 3], 48)
    assert (first.taskgraph, first.phase) == ("stage_1", "backward")


def test_find_collectives_resolves_v2_const_inputs_and_gather_input_shape():
    with tf.Graph().as_default() as graph:
        tensor = tf.compat.v1.placeholder(tf.float16, [5, 2], name="t")
        collective_ops.all_reduce_v2(tensor, 4, 7, 9)
        collective_ops.all_gather(tensor, 2, 3, 11)
        collective_ops.broadcast_recv_v2([3, 4], tf.float32, 2, 5, 6)
        graph_def = graph.as_graph_def(add_shapes=True)
    reduce_v2, gather, recv = find_collectives(graph_def)
    assert reduce_v2.kind == "CollectiveReduceV2"
    assert (reduce_v2.group_key, reduce_v2.group_size, reduce_v2.instance_key) == (7, 4, 9)
    assert (reduce_v2.dtype, reduce_v2.shape, reduce_v2.bytes) == ("float16", [5, 2], 20)
    assert gather.kind == "CollectiveGather" and gather.bytes == 20
    assert (recv.kind, recv.group, recv.shape, recv.bytes) == (
        "CollectiveBcastRecvV2", "key=5 size=2 instance=6", [3, 4], 48)


def _horovod_graph() -> graph_pb2.GraphDef:
    """Return a GraphDef with Horovod ops (not registered in this process)."""
    with tf.Graph().as_default() as graph:
        tf.compat.v1.placeholder(tf.float32, [3, 5], name="a")
        tf.compat.v1.placeholder(tf.float32, [2], name="b")
        tf.compat.v1.placeholder(tf.float32, [None, 2], name="c")
        graph_def = graph.as_graph_def(add_shapes=True)
    for name, op, inputs in (("hvd_sum", "HorovodAllreduce", ["a"]),
                             ("hvd_group", "HorovodGroupedAllreduce", ["a", "b"]),
                             ("hvd_gather", "HorovodAllgather", ["c"])):
        node = graph_def.node.add(name=name, op=op, input=inputs, device="/device:CPU:0")
        node.attr["T"].type = tf.float32.as_datatype_enum
    return graph_def


def test_find_collectives_reports_horovod_ops():
    by_name = {c.name: c for c in find_collectives(_horovod_graph())}
    assert by_name["hvd_sum"].group == "horovod"
    assert (by_name["hvd_sum"].dtype, by_name["hvd_sum"].bytes) == ("float32", 60)
    assert (by_name["hvd_group"].num_tensors, by_name["hvd_group"].bytes) == (2, 68)
    assert (by_name["hvd_gather"].shape, by_name["hvd_gather"].bytes) == ([None, 2], None)


# --------------------------------------------------------------------------
# epl-dump DIR
# --------------------------------------------------------------------------


def test_show_reports_every_pass_with_counts_and_collectives(capsys, dump_dir, graphs):
    code, out, _ = _run(capsys, dump_dir)
    assert code == 0
    assert "(3 passes)" in out
    assert f"[000] input  duration 0.0 ms  ops {len(graphs[0].node)}" in out
    assert f"[001] replicate  duration 12.3 ms  ops {len(graphs[1].node)}" in out
    assert "[002] prune  duration -" in out
    replicate = out[out.index("[001]"):out.index("[002]")]
    assert _line_with(replicate, "by device:").split(": ", 1)[1].strip().startswith(
        "/device:CPU:0 1, /device:CPU:1 2, (unplaced) ")
    assert "stage_1 " in _line_with(replicate, "by taskgraph:")
    assert _line_with(replicate, "by taskgraph:").endswith("(none) 1")  # the placeholder
    assert ", apply 3, (none) 1" in _line_with(replicate, "by phase:")  # mul/y, mul, apply_w
    assert "by replica:   0 " in replicate and ", 1 2" in _line_with(replicate, "by replica")
    for name in (REDUCE_0, REDUCE_1, "allreduce_replica_1/grad_copy", "apply_w"):
        assert name in _line_with(replicate, "added 6:")
    assert "removed 0" in replicate
    assert "collectives 2:" in replicate
    row = _line_with(replicate, REDUCE_1, "collectives 2:").split()
    assert row == ["CollectiveReduce", REDUCE_1, "/device:CPU:1", "key=1", "size=2",
                   "instance=1", "float32", "[4,", "3]", "48", "B"]
    prune = out[out.index("[002]"):]
    assert "added 0" in prune and "removed 3: mul/y, mul, apply_w" in prune


def test_show_limit_truncates_names(capsys, dump_dir):
    _, out, _ = _run(capsys, "show", dump_dir, "--limit", "2", "--pass", "replicate")
    assert "[000]" not in out and "[001] replicate" in out
    assert _line_with(out, "added 6:").endswith("(+4 more)")


def test_show_json_has_the_same_content(capsys, dump_dir):
    code, out, _ = _run(capsys, "--json", dump_dir)
    assert code == 0
    report = json.loads(out)
    passes = report["passes"]
    assert [p["pass"] for p in passes] == ["input", "replicate", "prune"]
    replicate = passes[1]
    assert replicate["by_device"]["/device:CPU:1"] == 2
    assert replicate["by_phase"]["apply"] == 3
    assert replicate["added"]["count"] == 6 and replicate["added_removed_source"] == "summary"
    assert [(c["name"], c["dtype"], c["shape"], c["bytes"]) for c in replicate["collectives"]] == [
        (REDUCE_0, "float32", [4, 3], 48), (REDUCE_1, "float32", [4, 3], 48)]
    assert passes[2]["added_removed_source"] == "computed"
    assert passes[2]["removed"]["names"] == ["mul/y", "mul", "apply_w"]


# --------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------


def test_diff_by_pass_name_and_index_agree(capsys, dump_dir, graphs):
    code, by_name, _ = _run(capsys, "diff", "--dir", dump_dir, "input", "replicate")
    assert code == 0
    _, by_index, _ = _run(capsys, "diff", "--dir", dump_dir, "0", "1")
    assert by_name == by_index
    assert by_name.startswith("diff 000_input -> 001_replicate\n")
    assert f"ops: {len(graphs[0].node)} -> {len(graphs[1].node)} (+6)" in by_name
    assert REDUCE_0 in _line_with(by_name, "added 6:")
    assert "removed 0" in by_name and "changed 0" in by_name
    assert "collectives: 0 -> 2 (+2)" in by_name
    assert _line_with(by_name, "/device:CPU:1", "by device:").split() == [
        "/device:CPU:1", "0", "->", "2", "(+2)"]
    assert _line_with(by_name, "apply", "by phase:").split() == ["apply", "0", "->", "3", "(+3)"]


def test_diff_of_files_shows_changed_ops(capsys, dump_dir):
    file_a = os.path.join(dump_dir, "001_replicate.pb")
    file_b = os.path.join(dump_dir, "002_prune.pb")
    code, out, _ = _run(capsys, "diff", file_a, file_b)
    assert code == 0
    assert "removed 3: mul/y, mul, apply_w" in out
    assert "changed 1:" in out
    assert "  logits: device (unplaced) -> /device:CPU:0" in out
    assert "collectives: 2 -> 2 (+0)" in out


def test_diff_json(capsys, dump_dir):
    _, out, _ = _run(capsys, "diff", "--dir", dump_dir, "replicate", "prune", "--json")
    diff = json.loads(out)
    assert diff["changed"]["ops"] == {"logits": ["device (unplaced) -> /device:CPU:0"]}
    assert diff["by_phase"]["apply"] == [3, 0]
    assert diff["collectives"] == [2, 2]


# --------------------------------------------------------------------------
# dot and tensorboard
# --------------------------------------------------------------------------


def test_dot_clusters_by_device_and_highlights_collectives(capsys, dump_dir, tmp_path):
    out_path = str(tmp_path / "g.dot")
    code, out, _ = _run(capsys, "dot", "--dir", dump_dir, "replicate", "-o", out_path)
    assert code == 0 and out_path in out
    text = open(out_path, encoding="utf-8").read()
    assert text.startswith('digraph "001_replicate" {') and text.rstrip().endswith("}")
    assert text.count("subgraph cluster_") == 3
    assert 'label="/device:CPU:1"' in text
    assert 'label="logits\\nMatMul", fillcolor="#cfe2ff"' in text
    assert text.count('shape="doubleoctagon"') == 2
    assert f'label="{REDUCE_0}\\nCollectiveReduce"' in text
    assert " -> " in text


def test_dot_max_ops_keeps_collectives(capsys, tmp_path, dump_dir):
    graph_file = os.path.join(dump_dir, "001_replicate.pb")
    code, out, _ = _run(capsys, "dot", graph_file, "--max-ops", "3")
    assert code == 0
    assert out.count('label="') == 3 + 3 + 1  # 3 ops, 3 clusters at most, graph label
    assert out.count('shape="doubleoctagon"') == 2


def _event_graph_ops(event_file: str) -> set[str]:
    """Return the op names of the graph stored in a TensorBoard event file."""
    for event in tf.compat.v1.train.summary_iterator(event_file):
        if event.graph_def:
            graph_def = graph_pb2.GraphDef()
            graph_def.ParseFromString(event.graph_def)
            return {node.name for node in graph_def.node}
    return set()


def test_tensorboard_writes_graph_event_file(capsys, dump_dir, tmp_path):
    logdir = str(tmp_path / "tb")
    code, out, _ = _run(capsys, "tensorboard", "--dir", dump_dir, "1", "--logdir", logdir)
    assert code == 0 and "tensorboard --logdir" in out
    (event_file,) = [name for name in os.listdir(logdir) if name.startswith("events.out.tfevents")]
    assert REDUCE_1 in _event_graph_ops(os.path.join(logdir, event_file))


def test_tensorboard_writes_every_pass_and_unimportable_graphs(capsys, dump_dir, tmp_path):
    logdir = str(tmp_path / "tb")
    assert _run(capsys, "tensorboard", dump_dir, "--logdir", logdir)[0] == 0
    assert sorted(os.listdir(logdir)) == ["000_input", "001_replicate", "002_prune"]
    files = epl_dump.write_tensorboard(_horovod_graph(), str(tmp_path / "hvd"))
    assert "hvd_group" in _event_graph_ops(files[0])


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def test_missing_directory_is_a_clear_error(capsys, tmp_path):
    code, out, err = _run(capsys, str(tmp_path / "nope"))
    assert code == 2 and out == ""
    assert "dump directory" in err and "nope" in err and "does not exist" in err


def test_directory_without_manifest_lists_its_content(capsys, tmp_path):
    (tmp_path / "stray.txt").write_text("x")
    code, _, err = _run(capsys, str(tmp_path))
    assert code == 2
    assert "has no manifest.json" in err and "contains: stray.txt" in err


def test_unknown_pass_lists_available_passes(capsys, dump_dir):
    code, _, err = _run(capsys, "diff", "--dir", dump_dir, "input", "zero")
    assert code == 2
    assert "no pass 'zero'" in err
    assert "available passes: 0 (input), 1 (replicate), 2 (prune)" in err


def test_missing_graph_file_and_bad_arguments(capsys, tmp_path):
    code, _, err = _run(capsys, "dot", str(tmp_path / "g.pbtxt"))
    assert code == 2 and "does not exist" in err and "--dir" in err
    assert _run(capsys, "diff", "only_one")[0] == 2
    assert _run(capsys)[0] == 2


def test_select_pass_by_label(dump_dir):
    dumps = read_dump(dump_dir)
    assert dump_format.select_pass(dumps, "001_replicate").index == 1
    assert dump_format.select_pass(dumps, 2).pass_name == "prune"


# --------------------------------------------------------------------------
# Size and speed: elided constants, unchanged passes, lazy loading, ranks
# --------------------------------------------------------------------------


def _graph_with_constant(elements: int) -> graph_pb2.GraphDef:
    """A graph holding a float32 constant of `elements` values and a scalar one."""
    with tf.Graph().as_default() as graph:
        big = tf.constant(np.arange(elements, dtype=np.float32), name="big")
        tf.add(big, tf.constant(2.0, name="two"), name="sum")
        return graph.as_graph_def(add_shapes=True)


def test_large_constants_are_left_out_with_their_shape(tmp_path):
    directory = str(tmp_path / "d")
    path = write_pass_dump(directory, 0, "input", _graph_with_constant(100_000), {})
    assert os.path.getsize(path) < 2000   # the 400 kB constant is not in the file
    nodes = {node.name: node for node in load_graph_def(path).node}
    big, two = nodes["big"], nodes["two"]
    assert big.attr[dump_format.ELIDED_ATTR].i > 400_000
    assert [d.size for d in big.attr["value"].tensor.tensor_shape.dim] == [100_000]
    assert big.attr["value"].tensor.dtype == tf.float32.as_datatype_enum
    assert not big.attr["value"].tensor.tensor_content
    assert dump_format.ELIDED_ATTR not in two.attr
    assert tf.make_ndarray(two.attr["value"].tensor) == 2.0


def test_a_pass_that_changes_nothing_shares_the_previous_graph_file(tmp_path, capsys, graphs):
    directory = str(tmp_path / "d")
    write_pass_dump(directory, 0, "input", graphs[0], {})
    write_pass_dump(directory, 1, "replicate", graphs[1], {"notes": ["4 replicas"]})
    write_pass_dump(directory, 2, "zero", graphs[1],
                    {"duration_s": 0.001, "notes": ["zero.level is off"]})
    assert sorted(name for name in os.listdir(directory) if name.endswith(".pb")) == [
        "000_input.pb", "001_replicate.pb"]
    manifest = dump_format.read_manifest(directory)
    assert [(e["graph"], e["unchanged"]) for e in manifest] == [
        ("000_input.pb", False), ("001_replicate.pb", False), ("001_replicate.pb", True)]
    code, out, _ = _run(capsys, directory)
    assert code == 0
    assert (f"[002] zero  duration 1.0 ms  ops {len(graphs[1].node)}  unchanged "
            "(same graph as 001_replicate)\n  note: zero.level is off\n") in out
    assert "  note: 4 replicas\n" in out
    _, out, _ = _run(capsys, "--json", directory)
    zero = json.loads(out)["passes"][2]
    assert (zero["unchanged"], zero["same_as"], zero["notes"]) == (
        True, "001_replicate", ["zero.level is off"])
    # rewriting the pass that owns the shared file keeps the file for the later pass
    write_pass_dump(directory, 1, "replicate", graphs[0], {})
    assert os.path.isfile(os.path.join(directory, "001_replicate.pb"))
    assert read_dump(directory)[2].graph_def == graphs[1]


def test_show_of_one_pass_loads_only_that_graph(tmp_path, capsys, graphs):
    directory = str(tmp_path / "d")
    write_pass_dump(directory, 0, "input", graphs[0], {})
    write_pass_dump(directory, 1, "replicate", graphs[1], {"added": [], "removed": []})
    (tmp_path / "d" / "000_input.pb").write_bytes(b"not a graph")
    code, out, _ = _run(capsys, directory, "--pass", "replicate")
    assert code == 0 and "[001] replicate" in out
    code, _, err = _run(capsys, directory)
    assert code == 2 and "cannot parse" in err and "000_input.pb" in err


def test_diff_shows_only_the_inputs_that_changed():
    changes = epl_dump.input_changes(["a", "b:1", "^c", "^d"], ["a", "e", "f", "^d", "^g"])
    assert changes == ["input 1: b:1 -> e", "input 2: (none) -> f", "control +^g -^c"]
    assert epl_dump.input_changes(["a", "^c"], ["a", "^c"]) == []


def test_each_worker_writes_its_own_directory(tmp_path, capsys, graphs):
    root = str(tmp_path / "d")
    assert dump_format.rank_dump_dir(root, 0, 1) == root
    for rank in (0, 1):
        directory = dump_format.rank_dump_dir(root, rank, 2)
        assert directory == os.path.join(root, f"rank_{rank}")
        write_pass_dump(directory, 0, "input", graphs[rank], {})
    code, out, _ = _run(capsys, root)
    assert code == 0
    assert out.startswith(f"EPL dump {os.path.join(root, 'rank_0')} (1 passes; ranks 0, 1,"
                          " --rank R for another)")
    assert f"ops {len(graphs[0].node)}" in out
    code, out, _ = _run(capsys, root, "--rank", "1")
    assert code == 0 and f"ops {len(graphs[1].node)}" in out
    code, _, err = _run(capsys, root, "--rank", "5")
    assert (code, err) == (2, f"epl-dump: error: {root!r} has no dump of rank 5; ranks: 0, 1\n")


def test_dump_instrument_writes_under_the_worker_rank(tmp_path):
    from epl.runtime.cluster import Cluster
    from epl.passes.manager import DumpInstrument, PassContext
    ctx = PassContext(Cluster("CPU", 2, worker_rank=1, num_workers=2), None)
    with tf.Graph().as_default() as graph:
        tf.constant(1.0, name="c")
    DumpInstrument(str(tmp_path)).before(None, graph, ctx)
    assert os.listdir(tmp_path) == ["rank_1"]
    assert [d.pass_name for d in read_dump(str(tmp_path / "rank_1"))] == ["input"]


# --------------------------------------------------------------------------
# Corrupt dumps: a clear error, never a traceback
# --------------------------------------------------------------------------


@pytest.fixture()
def small_dump(tmp_path, graphs) -> str:
    """A dump of two passes, to corrupt."""
    directory = str(tmp_path / "d")
    write_pass_dump(directory, 0, "input", graphs[0], {})
    write_pass_dump(directory, 1, "replicate", graphs[1], {})
    return directory


HINT = "write a fresh dump (run the script again with debug.dump_dir set)"


@pytest.mark.parametrize("content,problem", [
    ('{"passes": [', "not valid JSON (Expecting value at line 1 column 13)"),
    ("[1, 2]", 'expected a JSON object with a list "passes", got a list'),
    ('{"passes": {"index": 0}}', 'expected a JSON object with a list "passes", got an object'),
    ('{"passes": [7]}', "entry 0 (7) is not a JSON object"),
    ('{"passes": [{"index": "0", "pass": "input", "graph": "000_input.pb"}]}',
     'entry 0 ({"index": "0", "pass": "input", "graph": "000_input.pb"}) has no integer'
     ' "index" >= 0'),
    ('{"passes": [{"index": 0, "pass": "input"}]}',
     'entry 0 ({"index": 0, "pass": "input"}) has no string "graph"'),
])
def test_corrupt_manifest_is_a_clear_error(capsys, small_dump, content, problem):
    path = os.path.join(small_dump, "manifest.json")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(content)
    code, out, err = _run(capsys, small_dump)
    assert (code, out) == (2, "")
    assert err == f"epl-dump: error: manifest {path!r} is corrupt: {problem}; {HINT}\n"


@pytest.mark.parametrize("content,problem", [
    ('{"duration_s": 0.1,', "not valid JSON (Expecting property name enclosed in double"
     " quotes at line 1 column 20)"),
    ('["a"]', "expected a JSON object, got a list"),
])
def test_corrupt_summary_is_a_clear_error(capsys, small_dump, content, problem):
    path = os.path.join(small_dump, "001_replicate.json")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(content)
    code, out, err = _run(capsys, "diff", "--dir", small_dump, "input", "replicate")
    assert (code, out) == (2, "")
    assert err == f"epl-dump: error: summary {path!r} is corrupt: {problem}; {HINT}\n"


def test_summary_that_is_not_utf8_is_a_clear_error(capsys, small_dump):
    path = os.path.join(small_dump, "000_input.json")
    with open(path, "wb") as handle:
        handle.write(b"\xff\xfe{}")
    code, _, err = _run(capsys, small_dump)
    assert code == 2
    assert err == (f"epl-dump: error: summary {path!r} is corrupt: not UTF-8 text (invalid"
                   f" start byte at byte 0); {HINT}\n")


def test_epl_dump_runs_without_tensorflow(dump_dir, tmp_path):
    """Every command reads TensorBoard's copy of the protos: TensorFlow is never imported."""
    import subprocess
    import sys
    from paths import ROOT
    script = f"""
import sys
from epl.tools.dump import main
codes = [main(["show", {dump_dir!r}]), main(["diff", "--dir", {dump_dir!r}, "0", "1"]),
         main(["dot", "--dir", {dump_dir!r}, "1", "-o", {str(tmp_path / "g.dot")!r}]),
         main(["tensorboard", {dump_dir!r}, "--logdir", {str(tmp_path / "tb")!r}])]
print("codes", codes, "tensorflow", "tensorflow" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "codes [0, 0, 0, 0] tensorflow False"
    assert REDUCE_0 in result.stdout and "digraph" in (tmp_path / "g.dot").read_text()
    [event_file] = os.listdir(tmp_path / "tb" / "001_replicate")
    assert REDUCE_1 in _event_graph_ops(str(tmp_path / "tb" / "001_replicate" / event_file))
