"""Structure of the graph the replicate and gradient passes build (R replicas, one worker).

Checks read EPL's node attributes (`_epl_replica`, `_epl_phase`,
`_epl_taskgraph`) and devices; names are checked only where EPL documents
them (the `EPL_REPLICA_<k>/` prefix of copies).
"""
from __future__ import annotations

import collections
import os

import pytest
import tensorflow as tf

import epl
from epl.errors import PassError
from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.collectives import is_collective, is_reduction_to_one_device
from epl.ir.graph_view import TrainingView, ancestors
from epl.passes import unit_functions, verify
from epl.passes.replication.result import Replication
from epl.tools import dump as epl_dump

VARIABLE_TYPES = ("VarHandleOp", "VariableV2")
PIPELINE = ["auto_stages", "annotate", "amp", "recompute", "replicate", "consistency",
            "accumulate", "unscale", "schedule", "zero", "gradient_comm", "apply_groups",
            "skip_on_overflow", "offload", "verify", "unit_functions"]


def _replica(op) -> int | None:
    attr = op.node_def.attr.get(REPLICA_ATTR)
    return attr.i if attr is not None else None


def _phase(op) -> str | None:
    attr = op.node_def.attr.get(PHASE_ATTR)
    return attr.s.decode() if attr is not None else None


def _parallelize(models, epl_env, replicas, optimizer="adam", model="mlp", config=None, **kwargs):
    """Build `model` with EPL on `replicas` virtual devices and parallelize it, reducing
    with TensorFlow's collectives (what GPUs run; the CPU default, the sum on one
    device, is test_cpu_devices_sum_each_bucket_on_one_device's)."""
    epl_env({"cluster.virtual_devices": replicas, "debug.check_invariants": True,
             "communication.local_reduction": "collective", **(config or {})})
    graph = tf.Graph()
    with graph.as_default():
        built = models.build(model=model, optimizer=optimizer, **kwargs)
        result = epl.parallelize(graph)
    return graph, built, result


def _template_forward(view):
    return [op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_forward_copies_per_replica(models, epl_env, model, replicas):
    graph, _, result = _parallelize(models, epl_env, replicas, model=model)
    assert result.plan.num_replicas == replicas
    template = _template_forward(result.view)
    assert template
    for k in range(replicas):
        forward = [op for op in graph.get_operations() if _replica(op) == k
                   and _phase(op) == "forward" and op.type not in VARIABLE_TYPES]
        # the copies, and the unit_functions pass's call that runs them (on by default;
        # with one unit, nothing to share: no call)
        copies = [op for op in forward if op.type not in unit_functions.CALL_TYPES]
        calls = [op for op in forward if op.type in unit_functions.CALL_TYPES]
        assert len(copies) == len(template), f"replica {k}"
        assert len(calls) == (replicas > 1)
        assert all(call.device == f"/device:CPU:{k}" for call in calls)
        assert {op.device for op in copies} == {f"/device:CPU:{k}"}
        assert all(op.name.startswith(f"EPL_REPLICA_{k}/") for op in copies)
        backward = [op for op in graph.get_operations()
                    if _replica(op) == k and _phase(op) == "backward"]
        assert backward and {op.device for op in backward} == {f"/device:CPU:{k}"}
    assert max(_replica(op) or 0 for op in graph.get_operations()) == replicas - 1
    # The templates stay where they were built, unmarked, on replica 0's device.
    assert all(_replica(op) is None for op in template)


def _collectives(graph):
    return [op for op in graph.get_operations() if op.type.startswith("Collective")]


def _reducing_collectives(tensor):
    """The CollectiveReduce ops a (reduced) gradient tensor is computed from."""
    return [op for op in ancestors([tensor.op]) if op.type == "CollectiveReduce"]


def _check_updates_read_reduced_gradients(built, replicas, trainable, per_update):
    """Every optimizer update reads a gradient computed from `per_update` collective(s)
    on its own device, and each replica updates every trainable variable once."""
    updates = [op for op in ancestors([built.train_op]) if op.type == "ResourceApplyAdam"]
    assert len(updates) == replicas * len(trainable)
    assert collections.Counter(op.device for op in updates) == {
        f"/device:CPU:{k}": len(trainable) for k in range(replicas)}
    for op in updates:
        reducing = _reducing_collectives(op.inputs[-1])
        assert len(reducing) == per_update and reducing[0].device == op.device, op.name


# A fusion threshold of one byte and no cap on the bucket count: every gradient is its
# own bucket (no fusion).
UNFUSED = {"communication.fusion_threshold_mb": 1e-6, "communication.max_splits": 0}


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_one_collective_per_gradient_per_replica(models, epl_env, replicas):
    graph, built, result = _parallelize(models, epl_env, replicas, config=UNFUSED)
    trainable = graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
    assert len(result.view.gradients) == len(trainable) == 6
    collectives = _collectives(graph)
    if replicas == 1:
        assert collectives == []
        return
    assert {op.type for op in collectives} == {"CollectiveReduce"}
    assert len(collectives) == replicas * len(trainable)
    by_device = collections.Counter(op.device for op in collectives)
    assert by_device == {f"/device:CPU:{k}": len(trainable) for k in range(replicas)}
    assert all(op.get_attr("group_size") == replicas for op in collectives)
    by_instance = collections.defaultdict(list)
    for op in collectives:
        by_instance[op.get_attr("instance_key")].append(op)
    assert len(by_instance) == len(trainable)
    for ops in by_instance.values():
        assert sorted(op.device for op in ops) == [f"/device:CPU:{k}" for k in range(replicas)]
        assert len({op.get_attr("group_key") for op in ops}) == 1
    _check_updates_read_reduced_gradients(built, replicas, trainable, per_update=1)


@pytest.mark.parametrize("replicas", [2, 4])
def test_fused_collectives_cover_every_gradient_once(models, epl_env, replicas):
    """With the default fusion threshold the tiny gradients share one bucket: one
    collective per replica, and each update reads its gradient from exactly one."""
    graph, built, _ = _parallelize(models, epl_env, replicas)
    trainable = graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
    collectives = _collectives(graph)
    assert collections.Counter(op.device for op in collectives) == {
        f"/device:CPU:{k}": 1 for k in range(replicas)}
    assert all(op.get_attr("group_size") == replicas for op in collectives)
    _check_updates_read_reduced_gradients(built, replicas, trainable, per_update=1)


@pytest.mark.parametrize("replicas", [2, 4])
def test_cpu_devices_sum_each_bucket_on_one_device(models, epl_env, replicas, tmp_path,
                                                   capsys):
    """communication.local_reduction "auto" on CPU devices: each bucket is one AddN on
    the first device over every replica's bucket (carrying REDUCED_ATTR), no collective
    op; each other replica's updates read a copy on its own device; the verify pass
    takes the sum as the same on every replica (check_invariants), and epl-dump lists
    it with the collectives."""
    dump_dir = str(tmp_path / "dump")
    graph, built, _ = _parallelize(models, epl_env, replicas, config={
        "communication.local_reduction": "auto", "debug.dump_dir": dump_dir})
    assert not [op for op in graph.get_operations() if op.type.startswith("Collective")]
    sums = [op for op in graph.get_operations() if is_reduction_to_one_device(op)]
    assert len(sums) == 1 and sums[0].device == "/device:CPU:0"
    (total,) = sums
    assert [t.op.device for t in total.inputs] == [f"/device:CPU:{k}" for k in range(replicas)]
    near, frontier = set(), [total]    # the mean's division, then the copies
    for _ in range(2):
        frontier = [c for op in frontier for t in op.outputs for c in t.consumers()]
        near.update(frontier)
    assert {op.device for op in near if op.type == "Identity"} == {
        f"/device:CPU:{k}" for k in range(1, replicas)}
    assert is_collective(total)
    capsys.readouterr()
    assert epl_dump.main([dump_dir, "--limit", "100000"]) == 0
    assert f"one-device size={replicas}" in capsys.readouterr().out


@pytest.mark.parametrize("use_resource", [True, False])
@pytest.mark.parametrize("replicas", [2, 4])
def test_mirrored_variables(models, epl_env, replicas, use_resource):
    graph, _, result = _parallelize(models, epl_env, replicas, use_resource=use_resource)
    global_vars = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    originals = [v.op for v in global_vars]
    # (the unit functions' reference variable ops are no variables of the model)
    variable_ops = [op for op in graph.get_operations() if op.type in VARIABLE_TYPES
                    and op not in result.ref_marks]
    # Model variables, Adam slots and beta powers, and the global step are all mirrored.
    assert sorted(op.name for op in result.view.variables) == sorted(op.name for op in originals)
    assert set(result.sync_ops) == set(originals)
    for var in originals:
        assert var.device == "/device:CPU:0" and _replica(var) is None
        for k in range(1, replicas):
            mirrors = [op for op in variable_ops if op.name == f"EPL_REPLICA_{k}/{var.name}"]
            assert len(mirrors) == 1, var.name
            mirror = mirrors[0]
            assert mirror.type == var.type and _replica(mirror) == k
            assert mirror.device == f"/device:CPU:{k}"
            assert mirror.get_attr("dtype") == var.get_attr("dtype")
            assert mirror.get_attr("shape") == var.get_attr("shape")
            readers = [c for out in mirror.outputs for c in out.consumers()]
            assert any(_replica(c) == k for c in readers)
    # Mirrors are EPL's business: the user's collections (and so savers) hold originals only.
    assert len(variable_ops) == len(originals) * replicas
    assert graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) == global_vars


@pytest.mark.parametrize("replicas", [2, 4])
def test_every_op_has_taskgraph_and_device(models, epl_env, replicas):
    graph, _, _ = _parallelize(models, epl_env, replicas, model="transformer")
    missing = [op.name for op in graph.get_operations()
               if TASKGRAPH_ATTR not in op.node_def.attr or not op.device]
    assert missing == []
    assert {op.node_def.attr[TASKGRAPH_ATTR].s for op in graph.get_operations()} == {b"model"}


def test_templates_not_needed_and_verify_ran(models, epl_env, monkeypatch):
    after_passes, verified = [], []
    original_after = verify.InvariantInstrument.after
    original_run = verify.VerifyPass.run

    def spy_after(self, graph_pass, graph, ctx, result, duration_s):
        after_passes.append(graph_pass.name)
        return original_after(self, graph_pass, graph, ctx, result, duration_s)

    def spy_run(self, graph, ctx):
        verified.append(ctx)
        return original_run(self, graph, ctx)

    monkeypatch.setattr(verify.InvariantInstrument, "after", spy_after)
    monkeypatch.setattr(verify.VerifyPass, "run", spy_run)
    graph, built, result = _parallelize(models, epl_env, 2)
    assert after_passes == PIPELINE
    assert len(verified) == 1
    assert list(result.timings) == PIPELINE

    view = result.view
    template = set(_template_forward(view)) | {
        op for op in view.replica_ops if view.phase_of[op] == Phase.BACKWARD}
    needed = ancestors(view.train_ops)
    assert template and not template & needed
    # The loss fetch is remapped to the merged loss, which needs no template op either.
    merged = result.fetch_map[built.loss]
    assert not template & ancestors([merged.op])

    # The check itself catches a train op that needs a template op.
    ctx = verified[0]
    victim = _template_forward(view)[0]  # the first template op: it needs no other one
    with graph.as_default():
        built.train_op._add_control_inputs([victim])
    with pytest.raises(PassError, match="the train op still needs original") as err:
        verify.check_no_template_work(ctx.get(TrainingView), ctx.get(Replication))
    assert f"ops: {victim.name} (type {victim.type}" in str(err.value)
    assert "and " not in str(err.value).split("ops: ", 1)[1]  # exactly that op is named


def test_dump_and_epl_dump(models, epl_env, tmp_path, capsys):
    dump_dir = str(tmp_path / "dump")
    _parallelize(models, epl_env, 2, config={"debug.dump_dir": dump_dir, **UNFUSED})
    names = sorted(os.listdir(dump_dir))
    expected = ["input"] + PIPELINE
    from epl.observability.dump_format import read_manifest
    graph_files = {entry["pass"]: entry["graph"] for entry in read_manifest(dump_dir)}
    for index, name in enumerate(expected):
        assert graph_files[name] in names  # its own file, or the previous pass's when unchanged
        assert f"{index:03d}_{name}.json" in names
    assert "manifest.json" in names

    capsys.readouterr()
    assert epl_dump.main([dump_dir, "--limit", "100000"]) == 0
    out = capsys.readouterr().out
    for name in expected:
        assert f"] {name}" in out
    assert "EPL_REPLICA_1/" in out and "EPL_REPLICA_0/" in out
    assert "CollectiveReduce" in out and "size=2" in out
    assert "by replica:   0 " in out

    assert epl_dump.main(["diff", "--dir", dump_dir, "annotate", "replicate",
                          "--limit", "100000"]) == 0
    out = capsys.readouterr().out
    assert "EPL_REPLICA_1/" in out
    assert "/device:CPU:1" in out
    assert epl_dump.main(["diff", "--dir", dump_dir, "replicate", "gradient_comm"]) == 0
    out = capsys.readouterr().out
    assert "CollectiveReduce" in out
    assert "collectives: 0 -> 12 (+12)" in out
