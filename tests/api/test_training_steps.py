"""Any training step: tf.gradients, processing, and updates EPL finds in the graph.

BERT's optimization.py builds its step as `tf.gradients`, `clip_by_global_norm`,
then an optimizer whose apply_gradients is its own assign ops, and increments
the global step by hand (tests/bert_like.py writes that pattern from scratch).
EPL records the user's tf.gradients, finds the updates its gradients feed and
the op that runs them (the train op), and parallelizes that step like a
minimize(): the oracle holds under every strategy.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.ir.annotations import Phase
from epl.ir.graph_view import variable_written
from epl.hooks.session import parallel_graph

import bert_like

MICRO, UNITS, STEPS = 4, 4, 3
EXAMPLES = bert_like.make_examples(96, seed=1)
STRATEGIES = {
    "dp": ({"cluster.virtual_devices": 4}, {}),
    "pipeline_1f1b": ({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2,
                       "pipeline.strategy": "PreferBackward"}, {"stages": True}),
    "pipeline_gpipe": ({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2,
                        "pipeline.strategy": "PreferForward"}, {"stages": True}),
    "gc": ({"cluster.virtual_devices": 4, "gradient_checkpoint.type": "collection"},
           {"checkpoint_layers": True}),
    "amp": ({"cluster.virtual_devices": 4, "amp.level": "O1"}, {}),
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_bert_training_step_matches_single_device(strategy):
    """tf.gradients + clip_by_global_norm (over the reduced gradients) + a weight-decay
    Adam of assign ops + a hand-incremented global step: same numbers as plain TF."""
    config, build_kwargs = STRATEGIES[strategy]
    builder = bert_like.build_pretraining_custom
    result = bert_like.train(builder, MICRO, EXAMPLES, config, STEPS, **build_kwargs)
    parallel = parallel_graph(result[2])
    assert parallel.plan.num_replicas * int(config.get("pipeline.num_micro_batch", 1)) == UNITS
    assert result[1]["global_step"] == STEPS
    bert_like.assert_matches(result, bert_like.reference(builder, UNITS * MICRO, EXAMPLES, STEPS),
                             amp=strategy == "amp")
    if build_kwargs.get("stages"):
        _assert_slots_live_with_their_parameters(result[2])


def _assert_slots_live_with_their_parameters(graph):
    """BERT's optimizer creates its slots (`<param>/adam_m`, `<param>/adam_v`, the user's
    names) with get_variable outside every stage scope: each lives on its parameter's
    device, with its update, not on the first stage's. (TensorFlow's placer runs the
    other ops on a variable's handle, its initializer among them, where it lives.)"""
    view = parallel_graph(graph).view
    slots = [op for op in graph.get_operations() if op.type == "VarHandleOp"
             and op.name.endswith(("/adam_m", "/adam_v")) and not op.name.startswith("EPL")]
    devices = {graph.get_operation_by_name(op.name.rsplit("/", 1)[0]).device for op in slots}
    assert slots and len(devices) > 1, "parameters of several stages have slots"
    for slot in slots:
        param = graph.get_operation_by_name(slot.name.rsplit("/", 1)[0])
        assert slot.device == param.device, (slot.name, slot.device, param.device)
        updates = [op for op in slot.outputs[0].consumers() if variable_written(op) is slot
                   and view.phase_of.get(op) == Phase.APPLY]
        assert len(updates) == 1 and updates[0].device == param.device, updates


def _small_step(gradients_fn, use_epl: bool, rows: int, steps: int = 3):
    """A two-layer model trained by `gradients_fn(loss, variables, global_step) -> train op`."""
    env.reset()
    if use_epl:
        epl.init(epl.Config({"cluster.virtual_devices": 2, "debug.check_invariants": True}))
    data = np.random.RandomState(0)
    features, labels = data.randn(8, 5).astype(np.float32), data.randn(8, 2).astype(np.float32)
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [rows, 5])
        y = tf.compat.v1.placeholder(tf.float32, [rows, 2])
        with (epl.replicate(1) if use_epl else bert_like.contextlib.nullcontext()):
            h = tf.compat.v1.layers.dense(x, 7, activation=tf.nn.tanh, name="hidden",
                                          kernel_initializer=tf.constant_initializer(0.3))
            out = tf.compat.v1.layers.dense(h, 2, name="out",
                                            kernel_initializer=tf.constant_initializer(-0.2))
            loss = tf.reduce_mean(tf.square(out - y))
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train_op = gradients_fn(loss, tf.compat.v1.trainable_variables(), global_step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([train_op, loss], {x: features, y: labels})[1])
                      for _ in range(steps)]
            values = {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()}
    env.reset()
    return losses, values, graph


def _clip_then_apply(loss, variables, global_step):
    """EPL's set_default_scope_test pattern: tf.gradients, clip, apply_gradients."""
    grads = tf.gradients(loss, variables)
    grads, _ = tf.clip_by_global_norm(grads, 0.5)
    return tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).apply_gradients(
        zip(grads, variables), global_step=global_step)


def _compute_then_custom_apply(loss, variables, global_step):
    """compute_gradients (hooked), then an optimizer that overrides apply_gradients."""
    grads_and_vars = tf.compat.v1.train.GradientDescentOptimizer(0.1).compute_gradients(loss)
    optimizer = bert_like.AdamWeightDecayOptimizer(0.05)
    return tf.group(optimizer.apply_gradients(grads_and_vars), global_step.assign_add(1))


def _plain_assigns(loss, variables, global_step):
    """tf.compat.v1.gradients and plain assign_sub ops, one group, no optimizer at all."""
    grads = tf.compat.v1.gradients(loss, variables)
    updates = [v.assign_sub(0.1 * g) for v, g in zip(variables, grads)]
    return tf.group(*updates, global_step.assign_add(1))


def _decayed_then_increment(loss, variables, global_step):
    """BERT's order: a learning rate decayed by the global step, plain updates, and the
    global step incremented by hand beside them, nothing ordering it against the read."""
    learning_rate = tf.compat.v1.train.polynomial_decay(0.3, global_step, 4, end_learning_rate=0.0)
    grads = tf.compat.v1.gradients(loss, variables)
    updates = [v.assign_sub(learning_rate * g) for v, g in zip(variables, grads)]
    return tf.group(*updates, global_step.assign(global_step + 1))


def _decayed_then_ordered_increment(loss, variables, global_step):
    """`_decayed_then_increment` with the order its author means written out."""
    learning_rate = tf.compat.v1.train.polynomial_decay(0.3, global_step, 4, end_learning_rate=0.0)
    grads = tf.compat.v1.gradients(loss, variables)
    updates = [v.assign_sub(learning_rate * g) for v, g in zip(variables, grads)]
    with tf.control_dependencies([learning_rate]):
        return tf.group(*updates, global_step.assign(global_step + 1))


@pytest.mark.parametrize("gradients_fn", [_clip_then_apply, _compute_then_custom_apply,
                                          _plain_assigns],
                         ids=["clip-then-apply", "custom-apply", "plain-assigns"])
def test_training_steps_without_minimize_match_single_device(gradients_fn):
    reference = _small_step(gradients_fn, False, 8)
    result = _small_step(gradients_fn, True, 4)
    assert sorted(result[1]) == sorted(reference[1])
    for name, value in reference[1].items():
        np.testing.assert_allclose(result[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5, atol=1e-6)
    assert parallel_graph(result[2]).plan.num_replicas == 2


def test_a_hand_written_increment_waits_for_the_reads_built_before_it(caplog):
    """The global step's increment waits for the learning rate's read of it (the annotate
    pass writes the order), so every replica's updates use this step's learning rate on
    any placement; the read inside the increment needs no edge.

    Plain TensorFlow leaves the two unordered, and on this model its executor happens to
    run the increment first; EPL keeps the order the script built them in, so the
    reference is the script with that order written out."""
    reference = _small_step(_decayed_then_ordered_increment, False, 8)
    with caplog.at_level("WARNING", logger="epl.passes.annotate"):
        losses, values, graph = _small_step(_decayed_then_increment, True, 4)
    for name, value in reference[1].items():
        np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5, atol=1e-6)
    view = parallel_graph(graph).view
    assert len(view.write_orders) == 1
    read, write = view.write_orders[0]
    assert read.type == "ReadVariableOp" and write.type == "AssignVariableOp"
    assert read.inputs[0].op is write.inputs[0].op      # the global step, both
    assert read in write.control_inputs
    assert read not in (t.op for t in write.inputs[1].op.inputs)
    # the user is told which two ops were unordered, the order EPL chose, and how to choose
    warned = [r.getMessage() for r in caplog.records if r.name == "epl.passes.annotate"]
    assert warned == [
        f"{write.name} writes a variable that {read.name}, built before it, reads in the same "
        "step, and nothing orders the two: TensorFlow may run either first. EPL runs the read "
        "first, in the order the script built them (as tf.function does); add "
        "tf.control_dependencies to choose another order."]


def test_gradient_penalty_inside_the_loss_is_not_a_step():
    """tf.gradients used inside the forward pass (a gradient penalty) stays forward; the
    training step is the optimizer's, and training matches single-device."""
    def build(use_epl, rows):
        env.reset()
        if use_epl:
            epl.init(epl.Config({"cluster.virtual_devices": 2, "debug.check_invariants": True}))
        with tf.Graph().as_default() as graph:
            x = tf.compat.v1.placeholder(tf.float32, [rows, 3])
            w = tf.compat.v1.get_variable("w", initializer=np.full([3, 1], 0.5, np.float32))
            score = tf.matmul(tf.tanh(x), w)
            penalty = tf.reduce_mean(tf.square(tf.gradients(tf.reduce_sum(score), x)[0]))
            loss = tf.reduce_mean(score) + penalty
            train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
            data = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                losses = [float(sess.run([train_op, loss], {x: data})[1]) for _ in range(3)]
                value = sess.run(w)
        env.reset()
        return losses, value, graph
    reference, result = build(False, 8), build(True, 4)
    np.testing.assert_allclose(result[1], reference[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5, atol=1e-6)
    view = parallel_graph(result[2]).view
    assert len(view.steps) == 1 and not view.steps[0].from_gradients


def test_updates_without_one_op_that_runs_them_are_refused():
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        with epl.replicate(1):
            w = tf.compat.v1.get_variable("w", [3, 1])
            b = tf.compat.v1.get_variable("b", [1])
            loss = tf.reduce_mean(tf.matmul(x, w) + b)
        grad_w, grad_b = tf.gradients(loss, [w, b])
        w.assign_sub(0.1 * grad_w)
        b.assign_sub(0.1 * grad_b)   # two updates, no op that runs both
        before = len(graph.get_operations())
        with pytest.raises(epl.ParallelizeError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == before
    assert str(err.value) == (
        "the gradients of loss Mean:0 update variables (b, w) but no single op runs every "
        "update, so EPL cannot tell which op is the training step. Group the updates into one "
        "op (tf.group) and run that op.")


def test_gradients_that_update_nothing_are_no_training_step():
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        with epl.replicate(1):
            w = tf.compat.v1.get_variable("w", [3, 1])
            loss = tf.reduce_mean(tf.matmul(x, w))
        tf.gradients(loss, [w])   # a saliency map, say: never applied
        with pytest.raises(epl.ParallelizeError) as err:
            epl.parallelize(graph)
    assert str(err.value) == (
        "the graph has EPL strategy annotations but no training step: EPL parallelizes the step "
        "that updates trainable variables from gradients (Optimizer.minimize, compute_gradients "
        "or tf.gradients, then apply_gradients or assign ops); the gradients recorded (Mean:0) "
        "update no variable. Build the training step before creating the session or calling "
        "epl.parallelize(); an inference-only graph needs no EPL scopes.")


def _split_step(gradients_fn, use_epl: bool, steps: int = 3):
    """A replicated hidden layer and a classifier under epl.split(2), trained by the
    script's own tf.gradients (`gradients_fn(loss, variables) -> train op`)."""
    env.reset()
    if use_epl:
        epl.init(epl.Config({"cluster.virtual_devices": 2,
                             "cluster.colocate_split_and_replicate": True}))
    data = np.random.RandomState(5)
    features, labels = data.randn(8, 5).astype(np.float32), data.randint(0, 6, 8)
    rows = 4 if use_epl else 8
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [rows, 5])
        y = tf.compat.v1.placeholder(tf.int64, [rows])
        with (epl.replicate(1) if use_epl else bert_like.contextlib.nullcontext()):
            h = tf.compat.v1.layers.dense(x, 7, activation=tf.nn.tanh, name="hidden",
                                          kernel_initializer=tf.constant_initializer(0.3))
        with (epl.split(2) if use_epl else bert_like.contextlib.nullcontext()):
            w = tf.compat.v1.get_variable("classes", initializer=np.linspace(
                -1, 1, 42, dtype=np.float32).reshape(7, 6))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(h, w)))
        train_op = gradients_fn(loss, tf.compat.v1.trainable_variables())
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([train_op, loss], {x: features, y: labels})[1])
                      for _ in range(steps)]
            values = {v.op.name: sess.run(v) for v in tf.compat.v1.trainable_variables()}
    env.reset()
    return losses, values


def _split_clip_then_adam(loss, variables):
    grads = tf.gradients(loss, variables)
    grads, _ = tf.clip_by_global_norm(grads, 0.5)
    return tf.compat.v1.train.AdamOptimizer(0.1).apply_gradients(zip(grads, variables))


def _split_plain_assigns(loss, variables):
    grads = tf.compat.v1.gradients(loss, variables)
    return tf.group(*[v.assign_sub(0.2 * g) for v, g in zip(variables, grads)])


@pytest.mark.parametrize("gradients_fn", [_split_clip_then_adam, _split_plain_assigns],
                         ids=["clip-then-adam", "plain-assigns"])
def test_tf_gradients_on_a_split_model_matches_single_device(gradients_fn):
    """The split pass rewrites the forward before the script's own tf.gradients too
    (it was refused): the split variable's gradient is its shards' gradients, which
    apply_gradients (or an assign on the variable) updates the shards with."""
    reference = _split_step(gradients_fn, False)
    result = _split_step(gradients_fn, True)
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5, atol=1e-6)
    for name, value in reference[1].items():
        np.testing.assert_allclose(result[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_own_session_between_a_tf_keras_model_and_fit_is_refused_with_what_to_do():
    """A tf-keras model built under an EPL scope, then a session the script opens itself
    before fit builds the training step: EPL cannot wait for the step (Keras's own
    session can, tests/integration/test_legacy_keras.py), and says what to do."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    keras = tf.keras   # tf-keras under TF_USE_LEGACY_KERAS=1 (the suite's setting)
    with tf.Graph().as_default():
        with epl.replicate(1):
            model = keras.Sequential([keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                      keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.legacy.Adam(0.01), loss="mse")
        with pytest.raises(epl.ParallelizeError) as err:
            tf.compat.v1.Session()
    env.reset()
    assert str(err.value).endswith(
        "no gradients were built. Build the training step before creating the session or "
        "calling epl.parallelize(); an inference-only graph needs no EPL scopes. If this is a "
        "tf-keras (legacy Keras) model in graph mode: EPL parallelizes it when fit or "
        "train_on_batch builds the training step. Open your own session before building the "
        "model (tf.compat.v1.keras.backend.set_session), or leave the session to Keras.")


def test_a_training_step_built_after_the_rewrite_is_refused():
    """apply_gradients on a graph EPL already rewrote (a second train op built after the
    first session): it would train one replica's copy on its share of the batch."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default():
        with epl.replicate(1):
            x = tf.compat.v1.placeholder(tf.float32, [4, 3])
            w = tf.compat.v1.get_variable("w", initializer=np.ones([3, 1], np.float32))
            loss = tf.reduce_mean(tf.matmul(x, w))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session():
            with pytest.raises(epl.ParallelizeError, match="already rewritten"):
                tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
    env.reset()
