"""Replica consistency: state a script keeps in variables stays what single-device training has.

Every variable that exists once per replica is written only from values equal on
every replica (epl/ir/consistency.py, epl/passes/consistency.py), or the graph is
refused before step 0. Written the way real scripts keep state: GPT-2 fine-tuning's
accumulate-then-apply optimizer wrapper (separate session.run calls), an
exponential moving average of the weights, a step counter and a running loss sum,
batch norm's UPDATE_OPS (both `batch_norm.moving_statistics` rules, against their
definitions), a custom Optimizer whose `_apply_dense` keeps extra state. The oracle:
the EPL run on R x M units of B rows equals single-device training on the
concatenated batch of R x M x B rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.hooks.session import parallel_graph

B, FEATURES, OUT = 4, 3, 2          # one unit's batch, input width, output width
UNITS = 2                           # replicas x micro-batches of every EPL run here
RNG = np.random.RandomState(7)
X = RNG.randn(64, FEATURES).astype(np.float32)
Y = RNG.randn(64, OUT).astype(np.float32)
DP = {"cluster.virtual_devices": 2}
GA = {"cluster.virtual_devices": 1, "pipeline.num_micro_batch": 2}
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _model(x, y):
    """A linear layer and a squared error, with fixed initial values; the loss."""
    w = tf.compat.v1.get_variable("w", initializer=np.linspace(-1, 1, FEATURES * OUT, dtype=np.float32)
                                  .reshape(FEATURES, OUT))
    b = tf.compat.v1.get_variable("b", initializer=np.zeros(OUT, np.float32))
    return tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))


def _inputs(kind: str, rows: int):
    """(features, labels, feed function) of a static-batch placeholder or a tf.data
    iterator over X, Y in order."""
    if kind == "dataset":
        data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(rows, drop_remainder=True)
        x, y = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
        return x, y, lambda i: None
    x = tf.compat.v1.placeholder(tf.float32, [rows, FEATURES], name="x")
    y = tf.compat.v1.placeholder(tf.float32, [rows, OUT], name="y")
    per_run = rows * (UNITS if env.is_initialized() else 1)
    return x, y, lambda i: {x: X[i * per_run:(i + 1) * per_run], y: Y[i * per_run:(i + 1) * per_run]}


def _run(script, config: dict | None, **kwargs):
    """Run `script(rows, **kwargs) -> (graph fn(sess) -> results)` single-device (config
    None: one batch of UNITS x B rows per run) or under EPL (one unit's B rows)."""
    env.reset()
    if config is not None:
        epl.init(epl.Config(dict(config)))
    rows = B if config is not None else UNITS * B
    with tf.Graph().as_default() as graph:
        loop = script(rows, **kwargs)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(tf.compat.v1.local_variables_initializer())
            results = loop(sess)
            names = {v.op.name: v for v in tf.compat.v1.global_variables()}
            results["variables"] = dict(zip(names, sess.run(list(names.values()))))
            results["graph"] = graph
            if config is not None:
                results["mirrors"] = _mirror_values(sess, graph)
    env.reset()
    return results


def _mirror_values(sess, graph) -> dict:
    """{variable name: [its value on each replica]} of every mirrored variable."""
    reads = {}
    for var, copies in parallel_graph(graph).replication.mirrors.items():
        if var.type != "VarHandleOp":
            reads[var.name] = [c.outputs[0] for c in copies]
            continue
        dtype = var.get_attr("dtype")
        reads[var.name] = []
        for copy in copies:
            with tf.device(copy.device):
                reads[var.name].append(tf.raw_ops.ReadVariableOp(resource=copy.outputs[0],
                                                                 dtype=dtype))
    return sess.run(reads)


def _assert_consistent(result):
    """Every replica holds the same value of every mirrored variable."""
    for name, values in result["mirrors"].items():
        for value in values[1:]:
            np.testing.assert_array_equal(value, values[0], err_msg=name)


def _assert_same(result, reference, keys):
    for key in keys:
        for index, (value, expected) in enumerate(zip(result[key], reference[key])):
            np.testing.assert_allclose(value, expected, err_msg=f"{key}[{index}]", **TOLERANCE)
    _assert_consistent(result)
    assert sorted(result["variables"]) == sorted(reference["variables"])
    for name, value in reference["variables"].items():
        np.testing.assert_allclose(result["variables"][name], value, err_msg=name, **TOLERANCE)


# -- the accumulate-then-apply wrapper (GPT-2 fine-tuning) ----------------------


class AccumulatingOptimizer:
    """The optimizer wrapper of the best-known GPT-2 fine-tuning script: accumulators
    zeroed by one op, `assign_add` of each gradient in one run per micro-batch, the
    update from the accumulators in a separate run (which returns the mean loss)."""

    def __init__(self, opt, var_list):
        self.opt, self.var_list = opt, var_list
        self.accum_vars = {v: tf.Variable(tf.zeros(v.shape), trainable=False) for v in var_list}
        self.total_loss = tf.Variable(tf.zeros(shape=[], dtype=tf.float32))
        self.count_loss = tf.Variable(tf.zeros(shape=[], dtype=tf.float32))

    def reset(self):
        updates = [a.assign(tf.zeros_like(a)) for a in self.accum_vars.values()]
        updates.append(self.total_loss.assign(tf.zeros(shape=[], dtype=tf.float32)))
        updates.append(self.count_loss.assign(tf.zeros(shape=[], dtype=tf.float32)))
        with tf.control_dependencies(updates):
            return tf.no_op()

    def compute_gradients(self, loss):
        grads = self.opt.compute_gradients(loss, self.var_list)
        updates = [self.accum_vars[v].assign_add(g) for (g, v) in grads]
        updates.append(self.total_loss.assign_add(loss))
        updates.append(self.count_loss.assign_add(1.0))
        with tf.control_dependencies(updates):
            return tf.no_op()

    def apply_gradients(self):
        grads = [(g, v) for (v, g) in self.accum_vars.items()]
        with tf.control_dependencies([self.opt.apply_gradients(grads)]):
            return self.total_loss / self.count_loss


def _accumulating_script(rows, inputs="placeholder", accumulate=2, applies=2):
    x, y, feed = _inputs(inputs, rows)
    loss = _model(x, y)
    opt = AccumulatingOptimizer(tf.compat.v1.train.AdamOptimizer(0.1),
                                tf.compat.v1.trainable_variables())
    reset, compute, apply = opt.reset(), opt.compute_gradients(loss), opt.apply_gradients()

    def loop(sess):
        losses, run = [], 0
        for _ in range(applies):
            sess.run(reset)
            for _ in range(accumulate):
                sess.run(compute, feed(run))
                run += 1
            losses.append(sess.run(apply))
        return {"losses": losses}
    return loop


def _accumulating_gradients_script(rows, inputs="dataset", accumulate=2, applies=2):
    """The same wrapper written with tf.gradients and `apply_gradients([(accum / count,
    var)])` (the update reads the mean of the accumulated gradients)."""
    x, y, feed = _inputs(inputs, rows)
    loss = _model(x, y)
    variables = tf.compat.v1.trainable_variables()
    accums = [tf.Variable(tf.zeros(v.shape), trainable=False) for v in variables]
    count = tf.Variable(0.0, trainable=False)
    reset = tf.group([a.assign(tf.zeros_like(a)) for a in accums] + [count.assign(0.0)])
    grads = tf.gradients(loss, variables)
    compute = tf.group([a.assign_add(g) for a, g in zip(accums, grads)] + [count.assign_add(1.0)])
    opt = tf.compat.v1.train.MomentumOptimizer(0.05, 0.9)
    apply = opt.apply_gradients([(a / count, v) for a, v in zip(accums, variables)])

    def loop(sess):
        losses, run = [], 0
        for _ in range(applies):
            sess.run(reset)
            for _ in range(accumulate):
                losses.append(sess.run([compute, loss], feed(run))[1])
                run += 1
            sess.run(apply)
        return {"losses": losses}
    return loop


@pytest.mark.parametrize("inputs", ["placeholder", "dataset"])
def test_accumulate_then_apply_wrapper_matches_single_device(inputs):
    """Each accumulation run adds the gradient over every unit's batch (the replicas'
    gradients reduced); the apply run updates every replica alike; the returned mean
    loss is the global batch's."""
    reference = _run(_accumulating_script, None, inputs=inputs)
    result = _run(_accumulating_script, DP, inputs=inputs)
    _assert_same(result, reference, ["losses"])


@pytest.mark.parametrize("config", [DP, GA], ids=["dp", "micro_batches"])
def test_accumulate_with_tf_gradients_and_apply_of_the_mean(config):
    reference = _run(_accumulating_gradients_script, None)
    result = _run(_accumulating_gradients_script, config)
    _assert_same(result, reference, ["losses"])


# -- moving average of the weights, step counter, running loss sum --------------


def _bookkeeping_script(rows, inputs="placeholder", steps=3):
    """Adam, an ExponentialMovingAverage of the weights run after each update, a step
    counter and a running loss sum in the script's own variables: one inside the step
    (the train op waits for it), one grouped with the train op."""
    x, y, feed = _inputs(inputs, rows)
    loss = _model(x, y)
    counter = tf.Variable(0, trainable=False, name="counter")
    loss_sum = tf.Variable(0.0, trainable=False, name="loss_sum")
    loss_sum_in_step = tf.Variable(0.0, trainable=False, name="loss_sum_in_step")
    with tf.control_dependencies([loss_sum_in_step.assign_add(loss)]):
        train_op = tf.compat.v1.train.AdamOptimizer(0.05).minimize(loss)
    ema = tf.train.ExponentialMovingAverage(0.9)
    with tf.control_dependencies([train_op]):
        averages = ema.apply(tf.compat.v1.trainable_variables())
    step = tf.group(averages, counter.assign_add(1), loss_sum.assign_add(loss * 2.0))

    def loop(sess):
        losses = [sess.run([step, loss], feed(i))[1] for i in range(steps)]
        return {"losses": losses, "averaged": sess.run(
            [ema.average(v) for v in tf.compat.v1.trainable_variables()])}
    return loop


@pytest.mark.parametrize("config", [DP, GA], ids=["dp", "micro_batches"])
def test_moving_average_counter_and_loss_sum_match_single_device(config):
    reference = _run(_bookkeeping_script, None)
    result = _run(_bookkeeping_script, config)
    _assert_same(result, reference, ["losses", "averaged"])
    assert result["variables"]["counter"] == 3


# -- a custom optimizer with extra state ------------------------------------------


class MaxNormOptimizer(tf.compat.v1.train.Optimizer):
    """A custom optimizer in the style of real ones: a slot keeping the running maximum
    of |gradient| (AdaMax-like), a non-slot step counter updated in _finish."""

    def __init__(self, learning_rate=0.1, decay=0.9):
        super().__init__(use_locking=False, name="MaxNorm")
        self._lr, self._decay = learning_rate, decay

    def _create_slots(self, var_list):
        self._create_non_slot_variable(0.0, "updates", var_list[0])
        for v in var_list:
            self._zeros_slot(v, "u", self._name)

    def _apply_dense(self, grad, var):
        u = self.get_slot(var, "u")
        u_t = u.assign(tf.maximum(self._decay * u, tf.abs(grad)))
        return var.assign_sub(self._lr * grad / (u_t + 1e-3)).op

    _resource_apply_dense = _apply_dense

    def _finish(self, update_ops, name_scope):
        counter = self._get_non_slot_variable("updates", graph=tf.compat.v1.get_default_graph())
        with tf.control_dependencies(update_ops):
            return tf.group(counter.assign_add(1.0), name=name_scope)


def _custom_optimizer_script(rows, steps=3):
    x, y, feed = _inputs("placeholder", rows)
    loss = _model(x, y)
    train_op = MaxNormOptimizer().minimize(loss)

    def loop(sess):
        return {"losses": [sess.run([train_op, loss], feed(i))[1] for i in range(steps)]}
    return loop


def test_custom_optimizer_with_extra_state_matches_single_device():
    reference = _run(_custom_optimizer_script, None)
    result = _run(_custom_optimizer_script, DP)
    _assert_same(result, reference, ["losses"])
    assert result["variables"]["updates"] == 3.0


# -- batch norm's moving statistics (UPDATE_OPS) ----------------------------------

MOMENTUM = 0.9


def _batch_norm_script(rows, steps=2):
    """tensorflow/models' TF1 pattern: batch norm in training mode, the train op built
    under tf.control_dependencies(UPDATE_OPS)."""
    x, y, feed = _inputs("placeholder", rows)
    normalized = tf.compat.v1.layers.batch_normalization(x, training=True, momentum=MOMENTUM)
    loss = _model(normalized, y)
    with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)

    def loop(sess):
        return {"losses": [sess.run([train_op, loss], feed(i))[1] for i in range(steps)]}
    return loop


def _expected_statistics(rule: str, steps: int = 2):
    """The moving mean and variance by the rule's definition: each step moves them
    towards the first unit's batch statistics ("replica0") or the mean of the units'
    ("mean"), batch norm's biased batch variance."""
    mean, variance = np.zeros(FEATURES), np.ones(FEATURES)
    for step in range(steps):
        units = [X[(step * UNITS + u) * B:(step * UNITS + u + 1) * B] for u in range(UNITS)]
        if rule == "replica0":
            units = units[:1]
        batch_mean = np.mean([u.mean(axis=0) for u in units], axis=0)
        batch_variance = np.mean([u.var(axis=0) for u in units], axis=0)
        mean = MOMENTUM * mean + (1 - MOMENTUM) * batch_mean
        variance = MOMENTUM * variance + (1 - MOMENTUM) * batch_variance
    return mean, variance


@pytest.mark.parametrize("rule", ["replica0", "mean"])
@pytest.mark.parametrize("layout", [DP, GA], ids=["dp", "micro_batches"])
def test_batch_norm_moving_statistics_follow_their_rule(rule, layout):
    """Once per step, on every replica alike, by the rule's definition, whatever the
    layout of the same units; under "mean" the moving mean is single-device
    training's on the global batch."""
    result = _run(_batch_norm_script, {**layout, "batch_norm.moving_statistics": rule})
    _assert_consistent(result)
    mean, variance = _expected_statistics(rule)
    values = result["variables"]
    np.testing.assert_allclose(values["batch_normalization/moving_mean"], mean, rtol=1e-5)
    np.testing.assert_allclose(values["batch_normalization/moving_variance"], variance, rtol=1e-5)
    if rule == "mean":
        reference = _run(_batch_norm_script, None)
        np.testing.assert_allclose(values["batch_normalization/moving_mean"],
                                   reference["variables"]["batch_normalization/moving_mean"],
                                   **TOLERANCE)


# -- what cannot be kept consistent is refused before any step ----------------------


def _tracking_script(rows, collect=False, steps=2):
    """A script that keeps the mean of its features in a variable, written in the
    training step; with `collect`, the mean is in GLOBAL_MEAN_OBJECTS (the remedy)."""
    x, y, feed = _inputs("placeholder", rows)
    loss = _model(x, y)
    feature_mean = tf.Variable(tf.zeros([FEATURES]), trainable=False, name="feature_mean")
    batch_mean = tf.reduce_mean(x, axis=0)
    if collect and env.is_initialized():
        epl.add_to_collection(batch_mean, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
    with tf.control_dependencies([feature_mean.assign(batch_mean)]):
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)

    def loop(sess):
        return {"losses": [sess.run([train_op, loss], feed(i))[1] for i in range(steps)]}
    return loop


def test_a_write_from_one_replicas_batch_is_refused_naming_it_and_the_remedy():
    env.reset()
    epl.init(epl.Config(DP))
    with tf.Graph().as_default() as graph:
        _tracking_script(B)
        before = len(graph.get_operations())
        with pytest.raises(epl.PassError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == before, "refused before any rewrite"
    assert str(err.value) == (
        "pass 'consistency' rejected the graph before any rewrite: variable feature_mean "
        "would hold a different value on each replica: AssignVariableOp (AssignVariableOp, in "
        "the training step) writes it, and its value is computed from the batch input x:0, "
        "without a reduction over the replicas. EPL keeps every replica's copy of a variable "
        "equal (docs/consistency.md). Remedy: compute the "
        "value from the loss, or add the tensor it is computed from to an EPL merge collection "
        "(epl.add_to_collection(t, epl.GraphKeys.GLOBAL_MEAN_OBJECTS) for a mean over "
        "examples, GLOBAL_SUM_OBJECTS for a sum or count), so the write reads its value over "
        "the global batch; for a moving statistic like batch norm's, add the write to "
        "tf.compat.v1.GraphKeys.UPDATE_OPS (batch_norm.moving_statistics then chooses the "
        "value); for a streaming metric, create its variables in "
        "tf.compat.v1.GraphKeys.METRIC_VARIABLES and only add to them.")


def test_the_refusals_remedy_gives_the_value_over_the_global_batch():
    """The remedy the error names, applied: the variable holds the mean over every
    unit's features, as single-device training on the concatenated batch."""
    reference = _run(_tracking_script, None, collect=True)
    result = _run(_tracking_script, DP, collect=True)
    _assert_same(result, reference, ["losses"])


def test_a_write_from_a_concatenated_merge_is_refused_with_the_collection_to_use():
    env.reset()
    epl.init(epl.Config(DP))
    with tf.Graph().as_default() as graph:
        x, y, _ = _inputs("placeholder", B)
        loss = _model(x, y)
        rows = x * 2.0
        epl.add_to_collection(rows, epl.GraphKeys.GLOBAL_CONCAT_OBJECTS)
        feature_mean = tf.Variable(tf.zeros([FEATURES]), trainable=False, name="feature_mean")
        with tf.control_dependencies([feature_mean.assign(tf.reduce_mean(rows, axis=0))]):
            tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(epl.PassError) as err:
            epl.parallelize(graph)
    env.reset()
    assert str(err.value) == (
        "pass 'consistency' rejected the graph before any rewrite: variable feature_mean is "
        "written by AssignVariableOp (AssignVariableOp) from mul:0, which is in "
        "epl.GraphKeys.GLOBAL_CONCAT_OBJECTS: its merge holds every replica's rows, another "
        "shape than the write reads. Write it from a mean or a sum over the rows "
        "(GLOBAL_MEAN_OBJECTS or GLOBAL_SUM_OBJECTS) instead.")
