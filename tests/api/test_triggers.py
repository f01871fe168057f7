"""What triggers the rewrite, and that the user's handles keep working afterwards.

Triggers: a plain tf.compat.v1.Session, a MonitoredTrainingSession (through
Scaffold.finalize), and an explicit epl.parallelize(). Each rewrites a graph
exactly once. The user's train_op, loss, global_step, savers and hooks stay
valid: the loss is the mean over the global batch, the global step counts
steps (not replicas), checkpoints hold single-device names and full shapes,
and a restore re-syncs the replicas' mirrored variables.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.passes.replication import replicate

STEPS = 5


@pytest.fixture
def rewrites(monkeypatch):
    """Counts ReplicatePass runs per graph: {graph: runs}."""
    counts = collections.Counter()
    original = replicate.ReplicatePass.run

    def counting_run(self, graph, ctx):
        counts[graph] += 1
        return original(self, graph, ctx)

    monkeypatch.setattr(replicate.ReplicatePass, "run", counting_run)
    return counts


TRACE = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)


def _executed(run_metadata) -> set:
    """Names of the nodes a traced run executed."""
    return {node.node_name for dev in run_metadata.step_stats.dev_stats for node in dev.node_stats}


def _check_merged_loss_ran(graph, loss, executed) -> None:
    """The run computed the merged loss from the replicas, not the template loss."""
    from epl.hooks.session import parallel_graph
    result = parallel_graph(graph)
    view = result.view
    template = {op.name for op in view.replica_ops  # the original forward and backward ops
                if view.phase_of[op].value in ("forward", "backward")}
    assert result.fetch_map[loss].op.name in executed
    assert loss.op.name in template and not template & executed


def _is_parallel(graph, replicas):
    from epl.hooks.session import parallel_graph
    result = parallel_graph(graph)
    return result is not None and result.plan.num_replicas == replicas


@pytest.mark.parametrize("replicas", [2, 4])
def test_plain_session_rewrites_once(models, epl_env, rewrites, replicas):
    reference = models.single_device(model="mlp", optimizer="adam")
    epl_env({"cluster.virtual_devices": replicas})
    with tf.Graph().as_default() as graph:
        built = models.build(model="mlp", optimizer="adam")
        train_name, loss_name = built.train_op.name, built.loss.name
        init = tf.compat.v1.global_variables_initializer()  # built before the rewrite
        assert rewrites[graph] == 0  # building the model rewrites nothing
        with tf.compat.v1.Session() as sess:
            assert rewrites[graph] == 1 and _is_parallel(graph, replicas)
            sess.run(init)
            # The loss alone, before any step, in every fetch form: the global-batch mean.
            first = reference.losses[0]
            np.testing.assert_allclose(sess.run(built.loss, built.feed), first, rtol=1e-5)
            np.testing.assert_allclose(sess.run(loss_name, built.feed), first, rtol=1e-5)
            metadata = tf.compat.v1.RunMetadata()
            fetched = sess.run({"loss": [built.loss], "step": built.global_step}, built.feed,
                               options=TRACE, run_metadata=metadata)
            _check_merged_loss_ran(graph, built.loss, _executed(metadata))
            np.testing.assert_allclose(fetched["loss"][0], first, rtol=1e-5)
            assert fetched["step"] == 0
            losses = []
            for step in range(STEPS):
                out = sess.run({"train": built.train_op, "loss": built.loss}, built.feed)
                assert out["train"] is None
                losses.append(out["loss"])
                assert sess.run(built.global_step) == step + 1  # one per step, not per replica
            np.testing.assert_allclose(losses, reference.losses, rtol=1e-5, atol=1e-6)
            values = models.variable_values(sess, graph)
        ops = len(graph.get_operations())
        with tf.compat.v1.Session() as sess:  # a second session on the same graph
            sess.run(init)
            sess.run(built.train_op, built.feed)
            assert sess.run(built.global_step) == 1
        assert len(graph.get_operations()) == ops
        assert epl.parallelize(graph) is epl.parallelize(graph)
        assert built.train_op.name == train_name and built.loss.name == loss_name
    assert rewrites[graph] == 1
    for name, value in reference.variables.items():
        np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_each_graph_rewritten_once(models, epl_env, rewrites):
    epl_env({"cluster.virtual_devices": 2})
    graphs = []
    for _ in range(2):
        with tf.Graph().as_default() as graph:
            built = models.build(model="mlp", optimizer="sgd")
            for _ in range(2):
                with tf.compat.v1.Session() as sess:
                    sess.run(tf.compat.v1.global_variables_initializer())
                    sess.run(built.train_op, built.feed)
            graphs.append(graph)
    assert dict(rewrites) == {graphs[0]: 1, graphs[1]: 1}


def test_graph_without_epl_step_is_not_rewritten(models, epl_env, rewrites):
    """A session on a graph without an optimizer step (e.g. an eval graph) is untouched."""
    epl_env({"cluster.virtual_devices": 2})
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        y = tf.reduce_sum(x * 2.0)
        with tf.compat.v1.Session() as sess:
            assert sess.run(y, {x: np.ones([4, 3], np.float32)}) == 24.0
    assert rewrites[graph] == 0 and not _is_parallel(graph, 2)


def test_explicit_parallelize_then_session(models, epl_env, rewrites):
    reference = models.single_device(model="transformer", optimizer="sgd")
    epl_env({"cluster.virtual_devices": 2})
    with tf.Graph().as_default() as graph:
        built = models.build(model="transformer", optimizer="sgd")
        result = epl.parallelize(graph)
        assert rewrites[graph] == 1 and result.plan.num_replicas == 2
        with tf.compat.v1.Session() as sess:
            assert rewrites[graph] == 1
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([built.train_op, built.loss], built.feed)[1] for _ in range(STEPS)]
            assert sess.run(built.global_step) == STEPS
            values = models.variable_values(sess, graph)
        assert epl.parallelize() is result  # the default graph, already parallelized
    assert rewrites[graph] == 1
    np.testing.assert_allclose(losses, reference.losses, rtol=1e-5, atol=1e-6)
    for name, value in reference.variables.items():
        np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


class _LossHook(tf.compat.v1.train.SessionRunHook):
    """Fetches the loss with every step, as a logging hook would."""

    def __init__(self, loss):
        self.loss = loss
        self.losses = []
        self.executed = []

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs({"loss": self.loss}, options=TRACE)

    def after_run(self, run_context, run_values):
        self.losses.append(run_values.results["loss"])
        self.executed.append(_executed(run_values.run_metadata))


@pytest.mark.parametrize("replicas", [2, 4])
def test_monitored_training_session_and_checkpoint(models, epl_env, rewrites, tmp_path, replicas):
    reference = models.single_device(model="mlp", optimizer="adam")
    epl_env({"cluster.virtual_devices": replicas})
    checkpoint_dir = str(tmp_path / "ckpt")
    with tf.Graph().as_default() as graph:
        built = models.build(model="mlp", optimizer="adam")
        hook = _LossHook(built.loss)
        losses = []
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoint_dir, save_summaries_steps=None,
                save_summaries_secs=None, log_step_count_steps=None,
                hooks=[tf.compat.v1.train.StopAtStepHook(last_step=STEPS), hook]) as sess:
            assert rewrites[graph] == 1 and _is_parallel(graph, replicas)
            while not sess.should_stop():
                losses.append(sess.run([built.train_op, built.loss], built.feed)[1])
    assert rewrites[graph] == 1
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, reference.losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hook.losses, reference.losses, rtol=1e-5, atol=1e-6)
    for executed in hook.executed:
        _check_merged_loss_ran(graph, built.loss, executed)

    # The checkpoint: single-device names and full shapes only, the trained values.
    checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
    assert checkpoint.endswith(f"-{STEPS}")
    saved = dict(tf.train.list_variables(checkpoint))
    assert saved == {name: list(np.shape(value)) for name, value in reference.variables.items()}
    assert tf.train.load_variable(checkpoint, "global_step") == STEPS
    for name, value in reference.variables.items():
        np.testing.assert_allclose(tf.train.load_variable(checkpoint, name), value,
                                   rtol=1e-5, atol=1e-6, err_msg=name)

    # A plain single-device script restores it.
    env.reset()
    with tf.Graph().as_default() as graph:
        models.build(model="mlp", optimizer="adam")
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, checkpoint)
            restored = models.variable_values(sess, graph)
    assert not _is_parallel(graph, replicas)
    for name, value in reference.variables.items():
        np.testing.assert_allclose(restored[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _train_from_checkpoint(models, checkpoint, steps, init_first):
    """Build the Adam MLP, (initialize,) restore `checkpoint`, train `steps` steps."""
    with tf.Graph().as_default() as graph:
        built = models.build(model="mlp", optimizer="adam")
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            if init_first:
                sess.run(tf.compat.v1.global_variables_initializer())
            saver.restore(sess, checkpoint)
            assert sess.run(built.global_step) == 2
            losses = [sess.run([built.train_op, built.loss], built.feed)[1] for _ in range(steps)]
            return losses, models.variable_values(sess, graph)


@pytest.mark.parametrize("replicas,init_first", [(2, True), (2, False), (4, True)])
def test_restore_resyncs_mirrors(models, epl_env, tmp_path, replicas, init_first):
    """saver.restore into the parallel graph, then training, equals the single-device run
    restored from the same checkpoint: the replicas' mirrors take the restored values."""
    env.reset()
    with tf.Graph().as_default():  # a checkpoint whose values differ from the initializers
        built = models.build(model="mlp", optimizer="adam", seed=1)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(2):
                sess.run(built.train_op, built.feed)
            checkpoint = saver.save(sess, str(tmp_path / "model.ckpt"))
    ref_losses, ref_values = _train_from_checkpoint(models, checkpoint, 3, init_first=True)

    epl_env({"cluster.virtual_devices": replicas})
    losses, values = _train_from_checkpoint(models, checkpoint, 3, init_first)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert sorted(values) == sorted(ref_values)
    for name, value in ref_values.items():
        np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
