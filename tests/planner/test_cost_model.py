"""Tests of epl.planner.cost_model against analytic counts."""

import contextlib
import math

import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from epl.errors import ConfigError
from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR
from epl.planner import cost_model as cm
from epl.planner import step_memory as sm
from epl.planner.profiles import get_profile

F32 = 4


def _graph():
    """A fresh graph as the default graph (eager stays on globally)."""
    return tf.Graph().as_default()


@contextlib.contextmanager
def _tagged(graph, phase, taskgraph="stage_0"):
    """Tag ops created inside with EPL's phase and TaskGraph attributes."""
    attrs = {PHASE_ATTR: attr_value_pb2.AttrValue(s=phase.encode()),
             TASKGRAPH_ATTR: attr_value_pb2.AttrValue(s=taskgraph.encode())}
    with graph._attr_scope(attrs):
        yield


def _ph(shape, dtype=tf.float32):
    return tf.compat.v1.placeholder(dtype, shape)


# ---------------------------------------------------------------- op_cost --

@pytest.mark.parametrize("ta, tb", [(False, False), (True, False),
                                    (False, True), (True, True)])
def test_matmul_flops_honour_transposes(ta, tb):
    m, k, n = 3, 4, 5
    with _graph():
        a = _ph([k, m] if ta else [m, k])
        b = _ph([n, k] if tb else [k, n])
        y = tf.matmul(a, b, transpose_a=ta, transpose_b=tb)
        cost = cm.op_cost(y.op)
    assert y.op.type == "MatMul"
    assert cost.flops == 2 * m * n * k
    assert cost.bytes_read == (m * k + k * n) * F32
    assert cost.bytes_written == cost.output_bytes == m * n * F32
    assert cost.exact


@pytest.mark.parametrize("adj_x, adj_y", [(False, False), (True, True)])
def test_batch_matmul_flops(adj_x, adj_y):
    batch, m, k, n = 2, 3, 4, 5
    with _graph():
        a = _ph([batch, k, m] if adj_x else [batch, m, k])
        b = _ph([batch, n, k] if adj_y else [batch, k, n])
        y = tf.matmul(a, b, adjoint_a=adj_x, adjoint_b=adj_y)
        v1 = tf.raw_ops.BatchMatMul(x=a, y=b, adj_x=adj_x, adj_y=adj_y)
        v3 = tf.raw_ops.BatchMatMulV3(x=a, y=b, Tout=tf.float32,
                                      adj_x=adj_x, adj_y=adj_y)
        costs = [cm.op_cost(t.op).flops for t in (y, v1, v3)]
    assert y.op.type.startswith("BatchMatMul")
    assert costs == [2 * batch * m * n * k] * 3


def test_batch_matmul_broadcast_batch_dims():
    with _graph():
        y = tf.matmul(_ph([2, 1, 3, 4]), _ph([6, 4, 5]))
        assert y.shape.as_list() == [2, 6, 3, 5]
        assert cm.op_cost(y.op).flops == 2 * (2 * 6) * 3 * 5 * 4


@pytest.mark.parametrize("stride, padding, out_hw", [
    (1, "SAME", 9), (2, "VALID", 4)])
def test_conv2d_and_its_gradients(stride, padding, out_hw):
    n, h, cin, cout, kh = 2, 9, 3, 4, 3
    expected = 2 * n * out_hw * out_hw * cout * kh * kh * cin
    with _graph():
        x = _ph([n, h, h, cin])
        w = _ph([kh, kh, cin, cout])
        y = tf.nn.conv2d(x, w, strides=stride, padding=padding)
        dx, dw = tf.compat.v1.gradients(tf.reduce_sum(y), [x, w])
        assert y.shape.as_list() == [n, out_hw, out_hw, cout]
        assert (dx.op.type, dw.op.type) == ("Conv2DBackpropInput",
                                            "Conv2DBackpropFilter")
        assert [cm.op_cost(t.op).flops for t in (y, dx, dw)] == [expected] * 3


def test_depthwise_conv_and_pooling():
    with _graph():
        x = _ph([2, 8, 8, 3])
        y = tf.nn.depthwise_conv2d(x, _ph([3, 3, 3, 2]), [1, 1, 1, 1], "SAME")
        pool = tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID")
        assert cm.op_cost(y.op).flops == 2 * (2 * 8 * 8 * 6) * 3 * 3
        assert cm.op_cost(pool.op).flops == (2 * 4 * 4 * 3) * 4


def _only_op(graph, op_type):
    """The single op of `op_type` in `graph`."""
    (op,) = [op for op in graph.get_operations() if op.type == op_type]
    return op


def test_elementwise_reductions_softmax_and_losses():
    with _graph() as graph:
        x = _ph([3, 4])
        _ = x + _ph([4])  # AddV2 with broadcasting
        tf.add_n([x, x, x])
        tf.reduce_sum(x, axis=1)
        tf.nn.log_softmax(x)
        tf.nn.softmax_cross_entropy_with_logits(labels=x, logits=x)
        tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=_ph([3], tf.int32), logits=x)
        types = ["AddV2", "AddN", "Sum", "LogSoftmax",
                 "SoftmaxCrossEntropyWithLogits",
                 "SparseSoftmaxCrossEntropyWithLogits"]
        costs = [cm.op_cost(_only_op(graph, t)).flops for t in types]
    assert costs == [12, 2 * 12, 12, 5 * 12, 8 * 12, 6 * 12]


def test_embedding_lookup_reads_gathered_rows_only():
    with _graph() as graph:
        table = tf.compat.v1.get_variable("table", [1000, 16])
        tf.nn.embedding_lookup(table, _ph([5], tf.int32))
        tf.gather(_ph([1000, 16]), _ph([5], tf.int32))
        for op_type in ("ResourceGather", "GatherV2"):
            cost = cm.op_cost(_only_op(graph, op_type))
            assert cost.flops == 0
            assert cost.bytes_read == 5 * 16 * F32 + 5 * 4
            assert cost.bytes_written == 5 * 16 * F32


def test_no_cost_ops():
    with _graph() as graph:
        x = _ph([3, 4])
        tf.identity(x)
        tf.constant([1.0, 2.0])
        tf.compat.v1.get_variable("v", [3])
        tf.no_op()
        tf.reshape(x, [12])
        for op in graph.get_operations():
            if op.type in ("Placeholder", "Identity", "Const", "NoOp",
                           "VarHandleOp", "ReadVariableOp", "Reshape"):
                cost = cm.op_cost(op)
                assert (cost.flops, cost.bytes) == (0, 0), op.type


def test_unknown_shapes_count_what_is_known():
    with _graph():
        y = tf.matmul(_ph([None, 4]), _ph([4, 5]))
        guessed = cm.op_cost(y.op)
        with_batch = cm.op_cost(y.op, unknown_dim=8)
        unknown_rank = cm.op_cost(tf.nn.relu(_ph(None)).op)
    assert not guessed.exact and guessed.flops == 2 * 1 * 5 * 4
    assert not with_batch.exact and with_batch.flops == 2 * 8 * 5 * 4
    assert not unknown_rank.exact and unknown_rank.flops == 0


def test_unmodelled_op_type_is_flagged():
    with _graph():
        y = tf.linalg.cholesky(_ph([4, 4]))
        cost = cm.op_cost(y.op)
    assert not cost.exact and cost.flops == 0
    assert cost.bytes == 2 * 16 * F32
    assert not cm.is_modelled("Cholesky") and cm.is_modelled("MatMul")


def test_einsum_flops():
    with _graph():
        y = tf.einsum("bij,bjk->bik", _ph([2, 3, 4]), _ph([2, 4, 5]))
        z = tf.einsum("...ij,...jk->...ik", _ph([6, 3, 4]), _ph([4, 5]))
        assert y.op.type == "Einsum"
        assert cm.op_cost(y.op).flops == 2 * 2 * 3 * 4 * 5
        assert cm.op_cost(z.op).flops == 2 * 6 * 3 * 4 * 5


def test_attention_is_the_sum_of_its_parts():
    b, h, t, d = 2, 3, 5, 4
    with _graph() as graph:
        q, k, v = _ph([b, h, t, d]), _ph([b, h, t, d]), _ph([b, h, t, d])
        scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(d))
        tf.matmul(tf.nn.softmax(scores), v)
        (cost,) = cm.graph_cost(graph).values()
    qk = pv = 2 * b * h * t * t * d
    scale = b * h * t * t
    softmax = 5 * b * h * t * t
    assert cost.flops == qk + scale + softmax + pv
    assert cost.op_types["Softmax"] == 1 and cost.exact


def test_apply_op_cost():
    with _graph() as graph:
        var = tf.compat.v1.get_variable("w", [10, 3])
        with _tagged(graph, "apply"):
            tf.compat.v1.train.AdamOptimizer().apply_gradients(
                [(_ph([10, 3]), var)])
        (apply_op,) = [op for op in graph.get_operations()
                       if op.type == "ResourceApplyAdam"]
        cost = cm.op_cost(apply_op)
    assert cost.flops == 12 * 30
    assert cost.bytes_written == 3 * 30 * F32
    assert cost.bytes_read == 4 * 30 * F32


# -------------------------------------------------------------- graph_cost --

def test_graph_cost_groups_by_taskgraph_attr_and_parameter_bytes():
    with _graph() as graph:
        with _tagged(graph, "forward", "stage_0"):
            x = _ph([8, 16])
            w0 = tf.compat.v1.get_variable("w0", [16, 32])
            hidden = tf.nn.relu(tf.matmul(x, w0))
        with _tagged(graph, "forward", "stage_1"):
            w1 = tf.compat.v1.get_variable("w1", [32, 4])
            tf.matmul(hidden, w1)
        tf.constant(1.0)  # untagged: TaskGraph None
        costs = cm.graph_cost(graph, cm.by_taskgraph)
        by_phase = cm.graph_cost(graph.as_graph_def(),
                                 cm.by_taskgraph_and_phase)
    assert set(costs) == {"stage_0", "stage_1", None}
    stage0, stage1 = costs["stage_0"], costs["stage_1"]
    # Glorot initializers: RandomUniform, Mul and AddV2 per element, plus
    # one scalar Sub (maxval - minval).
    assert stage0.flops == 2 * 8 * 32 * 16 + 8 * 32 + (3 * 16 * 32 + 1)
    assert stage1.flops == 2 * 8 * 4 * 32 + (3 * 32 * 4 + 1)
    assert stage0.parameter_bytes == 16 * 32 * F32
    assert stage1.parameter_bytes == 32 * 4 * F32
    assert stage0.op_types["MatMul"] == 1 and stage0.num_ops == sum(
        stage0.op_types.values())
    assert costs[None].num_ops == 1 and costs[None].flops == 0
    assert by_phase[("stage_1", "forward")] == stage1
    total = cm.graph_cost(graph)[cm.ALL]
    assert total.flops == stage0.flops + stage1.flops


# ---------------------------------------------------------- memory_estimate --

def _mlp(graph, batch, sizes, optimizer=None):
    """A tagged ReLU MLP with a softmax loss; returns its variables."""
    with _tagged(graph, "forward"):
        x = _ph([batch, sizes[0]])
        labels = _ph([batch], tf.int32)
        weights, biases, h = [], [], x
        for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
            weights.append(tf.compat.v1.get_variable(f"w{i}",
                                                     [fan_in, fan_out]))
            biases.append(tf.compat.v1.get_variable(f"b{i}", [fan_out]))
            h = tf.nn.bias_add(tf.matmul(h, weights[-1]), biases[-1])
            if i < len(sizes) - 2:
                h = tf.nn.relu(h)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=h))
    variables = weights + biases
    with _tagged(graph, "backward"):
        grads = tf.compat.v1.gradients(loss, variables)
    if optimizer is not None:
        with _tagged(graph, "apply"):
            optimizer.apply_gradients(zip(grads, variables))
    return variables


def test_activation_bytes_of_a_two_layer_mlp():
    batch, d_in, hidden, classes = 8, 5, 7, 3
    with _graph() as graph:
        variables = _mlp(graph, batch, [d_in, hidden, classes])
        (memory,) = sm.memory_estimate(graph, variables, "sgd").values()
        halved = sm.memory_estimate(graph, variables, "sgd",
                                    amp_dtype=tf.float16)[cm.ALL]
        kinds = [t.op.type for t in sm.activation_tensors(graph)]
    # Kept for backward: the input x (for dW0 = x^T dy), the ReLU output
    # (for ReluGrad and dW1 = h^T dy) and the loss's softmax-minus-labels
    # backprop output.  Pre-activations and logits are not read backward.
    assert kinds == ["Placeholder", "Relu",
                     "SparseSoftmaxCrossEntropyWithLogits"]
    assert memory.activations == F32 * batch * (d_in + hidden + classes)
    # AMP O1: only x, read by nothing but the product dW0 = x^T dy, is kept as a
    # float16 cast; the ReLU output (also read by ReluGrad) and the loss's
    # backprop stay float32
    assert halved.activations == F32 * batch * (d_in / 2 + hidden + classes)
    params = F32 * (d_in * hidden + hidden + hidden * classes + classes)
    assert (memory.parameters, memory.gradients) == (params, params)
    assert memory.optimizer_slots == 0 and memory.exact
    assert memory.total == 2 * params + memory.activations


def test_optimizer_slots_sgd_adam_and_zero():
    with _graph() as graph:
        variables = _mlp(graph, 4, [6, 5, 2],
                         tf.compat.v1.train.AdamOptimizer())
        params = F32 * (6 * 5 + 5 + 5 * 2 + 2)
        estimate = lambda opt, **kw: sm.memory_estimate(  # noqa: E731
            graph, variables, opt, **kw)[cm.ALL]
        assert estimate("sgd").optimizer_slots == 0
        assert estimate("momentum").optimizer_slots == params
        assert estimate("adam").optimizer_slots == 2 * params
        assert estimate("AdamOptimizer").optimizer_slots == 2 * params
        assert estimate("adam", zero_shards=4).optimizer_slots == params / 2
        assert estimate("rmsprop").optimizer_slots == 2 * params
        assert sm.memory_estimate(graph, None, "adagrad")[cm.ALL] \
            .optimizer_slots == params  # the graph's trainable collection
        with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
            estimate("lion")
        with pytest.raises(ConfigError, match="zero_shards"):
            estimate("adam", zero_shards=0)
        with pytest.raises(ConfigError, match="amp_dtype"):
            estimate("adam", amp_dtype="int8")


def test_memory_groups_by_taskgraph():
    with _graph() as graph:
        with _tagged(graph, "forward", "stage_0"):
            x = _ph([4, 3])
            w0 = tf.compat.v1.get_variable("w0", [3, 6])
            h = tf.nn.relu(tf.matmul(x, w0))
        with _tagged(graph, "forward", "stage_1"):
            w1 = tf.compat.v1.get_variable("w1", [6, 2])
            loss = tf.reduce_sum(tf.matmul(h, w1))
        with _tagged(graph, "backward", "stage_1"):
            tf.compat.v1.gradients(loss, [w0, w1])
        memory = sm.memory_estimate(graph, [w0, w1], "adam", cm.by_taskgraph)
    assert memory["stage_0"].parameters == 3 * 6 * F32
    assert memory["stage_1"].parameters == 6 * 2 * F32
    assert memory["stage_0"].activations == (4 * 3 + 4 * 6) * F32
    assert memory["stage_1"].activations == 0


def test_checkpointing_keeps_sqrt_n_tensors_plus_one_segment():
    assert cm.checkpointed_bytes([]) == 0
    assert cm.checkpointed_bytes([5.0]) == 5
    # 9 tensors -> 3 segments of 3: keep 3 heads + the largest tail (2).
    assert cm.checkpointed_bytes([1.0] * 9) == 5
    # heads 9, 1, 1; tails [1, 1], [1, 1], [1, 7]: the largest tail is 8.
    assert cm.checkpointed_bytes([9, 1, 1, 1, 1, 1, 1, 1, 7]) == 9 + 1 + 1 + 8
    batch, width, layers = 2, 4, 8
    with _graph() as graph:
        with _tagged(graph, "forward"):
            h = _ph([batch, width])
            variables = []
            for i in range(layers):
                variables.append(tf.compat.v1.get_variable(f"w{i}",
                                                           [width, width]))
                h = tf.nn.relu(tf.matmul(h, variables[-1]))
            loss = tf.reduce_sum(h)
        with _tagged(graph, "backward"):
            tf.compat.v1.gradients(loss, variables)
        full = sm.memory_estimate(graph, variables, "sgd")[cm.ALL]
        kept = sm.memory_estimate(graph, variables, "sgd",
                                  checkpointing=True)[cm.ALL]
    tensor = batch * width * F32
    assert full.activations == (layers + 1) * tensor  # x and 8 ReLU outputs
    assert kept.activations == 5 * tensor


def test_untagged_graph_has_no_backward_phase_unless_phase_fn_says():
    with _graph() as graph:
        w = tf.compat.v1.get_variable("w", [3, 3])
        loss = tf.reduce_sum(tf.matmul(_ph([2, 3]), w))
        forward_ops = set(graph.get_operations())
        tf.compat.v1.gradients(loss, [w])
        memory = sm.memory_estimate(graph, [w], "sgd")[cm.ALL]
        assert memory.activations == 0
        by_fn = sm.memory_estimate(
            graph, [w], "sgd",
            phase_fn=lambda op: "forward" if op in forward_ops else "backward")
        assert by_fn[cm.ALL].activations == 2 * 3 * F32  # x, for dW


# -------------------------------------------------------------------- time --

def test_predict_time_roofline():
    v100 = get_profile("V100-32GB")
    compute_bound = cm.OpCost(flops=1e12, bytes_read=1e6)
    assert cm.predict_time(compute_bound, v100) == pytest.approx(
        1e12 / (15.7e12 * cm.DEFAULT_EFFICIENCY))
    assert cm.predict_time(compute_bound, v100, "float16", 1.0) == \
        pytest.approx(1e12 / 125e12)
    memory_bound = cm.GroupCost(flops=1e6, bytes=9e9)
    assert cm.predict_time(memory_bound, v100) == pytest.approx(0.01)
    with pytest.raises(ConfigError, match="efficiencies"):
        cm.predict_time(compute_bound, v100, efficiency=0)


def test_comm_time_ring_all_reduce():
    assert cm.comm_time(1e9, 1e10, 4) == pytest.approx(2 * 3 / 4 * 0.1)
    assert cm.comm_time(1e9, 1e10, 1) == 0
    assert cm.comm_time(0, 1e10, 3, latency=1e-5) == pytest.approx(4e-5)


# ------------------------------------------------------- per-op overhead --

def test_op_overhead_time_and_gpu_profiles_unaffected():
    cpu = get_profile("Slow", {"Slow": {"base": "A10", "op_overhead_s": "5us"}})
    assert cm.op_overhead_time(1000, cpu) == pytest.approx(5e-3)
    assert cm.op_overhead_time(0, cpu) == 0.0
    assert cm.op_overhead_time(1000, get_profile("A10")) == 0.0


def test_step_time_adds_op_overhead_and_collective_latency():
    from epl.planner.model_spec import LayerSpec, ModelSpec
    from epl.planner.planner import plan_cluster
    from epl.planner.profiles import HostSpec
    layer = LayerSpec("l", flops_per_example=1e6, bytes_per_example=1e4,
                      parameter_bytes=1e6,
                      op_counts=(("BatchMatMulV2", 100), ("MatMul", 300)))
    model = ModelSpec("m", (layer,), optimizer="sgd")
    base = get_profile("A10")
    slow = base.with_overrides(name="A10-slow", op_overhead_s=1e-5,
                               collective_latency_s=1e-4,
                               op_type_overhead_s={"BatchMatMulV2": "20us"})
    plain = plan_cluster(model, [HostSpec(base, 2)], global_batch=8)
    costly = plan_cluster(model, [HostSpec(slow, 2)], global_batch=8)
    name = "data-parallel, even split"
    extra = costly.alternative(name).step_time - plain.alternative(name).step_time
    # 400 ops x 10 us, 100 batched matmuls x 20 us more, one all-reduce's
    # 2 (n - 1) = 2 ring steps x 100 us, and the fusion copies (concat and
    # split: 4 x the gradients' bytes).
    copies = 4 * 1e6 / base.memory_bandwidth
    assert extra == pytest.approx(400 * 1e-5 + 100 * 2e-5 + 2 * 1e-4 + copies,
                                  rel=1e-6)


def test_replica_sync_adds_per_replica_beyond_the_first():
    from epl.planner.model_spec import LayerSpec, ModelSpec
    from epl.planner.planner import plan_cluster
    from epl.planner.profiles import HostSpec, virtual_cpu_profiles
    layer = LayerSpec("l", flops_per_example=1e6, parameter_bytes=1e6)
    model = ModelSpec("m", (layer,), optimizer="sgd")
    name = "data-parallel, even split"
    cpu = {"CPU": {"base": "A10", "replica_sync_s": "300us"}}
    steps = {}
    for sync in ("0us", "300us"):
        cpu["CPU"]["replica_sync_s"] = sync
        profile = virtual_cpu_profiles(4, cpu)[0]
        assert profile.replica_sync_s == pytest.approx(float(sync[:-2]) * 1e-6)
        steps[sync] = plan_cluster(model, [HostSpec(profile, 4)],
                                   global_batch=8).alternative(name).step_time
    # 3 replicas beyond the first, 300 us each.
    assert steps["300us"] - steps["0us"] == pytest.approx(3 * 3e-4, rel=1e-6)
    # One device has no replicas to wait for; the GPU table has no sync.
    assert get_profile("A10").replica_sync_s == 0.0
    one = virtual_cpu_profiles(1, cpu)[0]
    solo = plan_cluster(model, [HostSpec(one, 1)], global_batch=8)
    assert solo.alternative(name).rows[0].comm_s == 0.0


def test_input_reads_add_per_replica_and_per_example():
    from epl.planner.model_spec import LayerSpec, ModelSpec
    from epl.planner.planner import plan_cluster
    from epl.planner.profiles import HostSpec, virtual_cpu_profiles
    layer = LayerSpec("l", flops_per_example=1e6, parameter_bytes=1e6)
    model = ModelSpec("m", (layer,), optimizer="sgd")
    name = "data-parallel, even split"
    steps = {}
    for read, per_example in (("0us", "0us"), ("1ms", "1us")):
        cpu = {"CPU": {"base": "A10", "input_read_s": read,
                       "input_example_s": per_example}}
        profile = virtual_cpu_profiles(4, cpu)[0]
        steps[read] = plan_cluster(model, [HostSpec(profile, 4)],
                                   global_batch=8).alternative(name).step_time
    # 4 replicas read 1 ms each, 8 examples 1 us each.
    assert steps["1ms"] - steps["0us"] == pytest.approx(4e-3 + 8e-6, rel=1e-6)


def test_step_overhead_is_paid_once_per_step():
    from epl.planner.model_spec import LayerSpec, ModelSpec
    from epl.planner.planner import PlanOptions, plan_cluster
    from epl.planner.profiles import HostSpec, virtual_cpu_profiles
    layers = tuple(LayerSpec(f"l{i}", flops_per_example=1e6, parameter_bytes=1e6,
                             stage=i) for i in range(2))
    steps = {}
    for cost in ("0us", "400us"):
        cpu = {"CPU": {"base": "A10", "step_overhead_s": cost}}
        profile = virtual_cpu_profiles(2, cpu)[0]
        for stages, name in ((1, "data-parallel, even split"), (2, "pipeline, 2 stages")):
            model = ModelSpec("m", layers if stages == 2 else layers[:1],
                              optimizer="sgd")
            plan = plan_cluster(model, [HostSpec(profile, 2)], global_batch=8,
                                options=PlanOptions(num_micro_batch=4))
            steps[cost, stages] = plan.alternative(name).step_time
    # one session run per step: not per replica, not per micro-batch
    for stages in (1, 2):
        assert steps["400us", stages] - steps["0us", stages] == pytest.approx(4e-4, rel=1e-6)


def test_pipeline_on_shared_cores_is_bounded_by_the_host_work():
    from epl.planner.model_spec import LayerSpec, ModelSpec
    from epl.planner.planner import PlanOptions, plan_cluster
    from epl.planner.profiles import HostSpec, replica_speedup, virtual_cpu_profiles
    # two equal stages, 4 micro-batches: 5 slots of one stage's micro-batch
    layers = tuple(LayerSpec(f"l{i}", flops_per_example=1e9, stage=i) for i in range(2))
    model = ModelSpec("m", layers, optimizer="sgd")
    options = PlanOptions(num_micro_batch=4)
    name = "pipeline, 2 stages"
    cpu = {"CPU": {"base": "A10", "replica_concurrency": 1.2, "host_cores": 2}}
    shared = virtual_cpu_profiles(2, cpu)[0]
    assert shared.shared_by == 2
    own = shared.with_overrides(name="own", shared_by=1)
    compute = {p.shared_by: plan_cluster(model, [HostSpec(p, 2)], global_batch=8,
                                         options=options).alternative(name).rows[0].compute_s
               for p in (shared, own)}
    per_mb = 2 * 1e9 / (shared.flops() * 0.5)   # 2 examples per micro-batch
    # own cores: the stages wait through the fill and drain, 4 + 2 - 1 slots
    assert compute[1] == pytest.approx(5 * per_mb, rel=1e-6)
    # shared cores: an idle stage lends its cores; the host does the 8
    # micro-batch-stages of work at the 2 devices' combined rate, more than 5
    # slots of one stage alone
    share = replica_speedup(shared, 2) / 2
    assert compute[2] == pytest.approx(max(4 * 2 * per_mb / 2, 5 * per_mb * share), rel=1e-6)
    assert compute[2] < compute[1]


def test_op_overhead_time_by_type():
    profile = get_profile("T", {"T": {"base": "A10", "op_overhead_s": 1e-6,
                                      "op_type_overhead_s": {"Einsum": 5e-6}}})
    assert cm.op_overhead_time((("Einsum", 2), ("Add", 3)), profile) == \
        pytest.approx(2 * 6e-6 + 3 * 1e-6)
    assert cm.op_overhead_time(4, profile) == pytest.approx(4e-6)


def test_optimizer_bandwidth_sets_the_update_time():
    from epl.planner.model_spec import LayerSpec, ModelSpec
    from epl.planner.planner import plan_cluster
    from epl.planner.profiles import HostSpec
    layer = LayerSpec("l", flops_per_example=1e3, parameter_bytes=4e8)
    model = ModelSpec("m", (layer,), optimizer="sgd")
    base = get_profile("A10")
    slow = base.with_overrides(name="A10-slow-update",
                               optimizer_bandwidth="1GB/s")
    name = "data-parallel, even split"
    plain = plan_cluster(model, [HostSpec(base, 1)], global_batch=1)
    costly = plan_cluster(model, [HostSpec(slow, 1)], global_batch=1)
    # SGD moves 3 x the parameters; at 1 GB/s instead of the A10's 600 GB/s.
    extra = costly.alternative(name).step_time - plain.alternative(name).step_time
    assert extra == pytest.approx(3 * 4e8 / 1e9 - 3 * 4e8 / base.memory_bandwidth,
                                  rel=1e-3)
