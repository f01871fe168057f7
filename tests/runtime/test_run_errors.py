"""Run-time errors in the user's terms (epl.runtime.run_errors, epl.checkpoint.damage).

A model with two replicas (two virtual devices), so that TensorFlow's errors
name EPL's copies (`EPL_REPLICA_1/...`, `EPL_FEED/IteratorGetNext`); each test
checks the exact sentence EPL puts in front, that no copy's name is left, and
that the error is still the class TensorFlow raised (or a CheckpointError for
a checkpoint that cannot be read or written).
"""
import os
import re
import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf

from epl.checkpoint.damage import diagnose, last_good
from epl.errors import CheckpointError
from epl.hooks import session as session_hooks
from epl.hooks.record import record_of
from epl.hooks.session import parallel_graph
from epl.runtime.run_errors import own_ops, user_names
from multiworker import run_job, worker_script

ROWS = 4


def _model(epl_env, batches=4):
    """A dense model on a tf.data input of `batches` batches, 2 replicas."""
    epl_env({"cluster.virtual_devices": 2})
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones([batches * ROWS, 3], np.float32), np.ones([batches * ROWS, 1], np.float32)))
    x, y = tf.compat.v1.data.make_one_shot_iterator(
        data.batch(ROWS, drop_remainder=True)).get_next()
    import epl
    with epl.replicate(1):
        hidden = tf.compat.v1.layers.dense(x, 4, name="hidden")
        loss = tf.reduce_mean(tf.square(tf.compat.v1.layers.dense(hidden, 1, name="out") - y))
    step = tf.compat.v1.train.get_or_create_global_step()
    return tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)


def test_user_names_replaces_copies_by_the_users_ops():
    origins = {"EPL_REPLICA_1/out/kernel": ("out/kernel", "replica 1"),
               "EPL_FEED/IteratorGetNext": ("IteratorGetNext", "replica 1")}
    assert user_names("Could not find variable EPL_REPLICA_1/out/kernel. (Could not find "
                      "resource: localhost/EPL_REPLICA_1/out/kernel) "
                      "[[EPL_FEED/IteratorGetNext/_31]] x:0 EPL_REPLICA_1/out/kernel:0",
                      origins) == (
        "Could not find variable out/kernel (replica 1's copy). (Could not find resource: "
        "localhost/out/kernel (replica 1's copy)) [[IteratorGetNext (replica 1's copy)]] x:0 "
        "out/kernel (replica 1's copy):0")


def test_user_names_says_what_epls_own_ops_are():
    # an op a pass added that copies no user op (TensorFlow names it, or its transfer
    # node, beside the op that failed): named by the pass that added it
    own = {"EPL_FUSION_1/concat": "gradient_comm"}
    assert user_names("Could not find variable EPL_REPLICA_1/out/kernel. "
                      "[[EPL_FUSION_1/concat/_5]] EPL_FUSION_1/concat:0",
                      {"EPL_REPLICA_1/out/kernel": ("out/kernel", "replica 1")}, own) == (
        "Could not find variable out/kernel (replica 1's copy). "
        "[[EPL's own op (from its gradient_comm pass)]] "
        "EPL's own op (from its gradient_comm pass):0")


def test_every_op_epl_added_has_words_for_errors(epl_env):
    # whichever of the rewritten graph's ops TensorFlow names in an error (which
    # depends on timing: a cancelled transfer of a gradient all-reduce, say), the
    # message names no op of EPL's by its graph name
    with tf.Graph().as_default() as graph:
        train = _model(epl_env)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
        result = record_of(graph).result
        own = own_ops(result)
        added = [op.name for op in graph.get_operations()[:result.ops_after_rewrite]
                 if op.name.startswith("EPL_")]
    assert any(name in own for name in added)  # the gradient all-reduce, at least
    assert not [name for name in added if name not in own and name not in result.origins]
    assert user_names(" ".join("[[%s/_1]]" % name for name in added), result.origins,
                      own).count("EPL_") == 0


def test_uninitialized_variable_names_the_users_variable(epl_env):
    with tf.Graph().as_default():
        train = _model(epl_env)
        with tf.compat.v1.Session() as sess:
            with pytest.raises(tf.errors.FailedPreconditionError) as info:
                sess.run(train)
    message = str(info.value.message)
    assert re.match(
        r"at an unknown global step \(it cannot be read\): variable (hidden|out)/(kernel|bias) "
        r"is not initialized: run tf\.compat\.v1\.global_variables_initializer\(\) before the "
        r"first step \(or let MonitoredTrainingSession initialize or restore it\)\. "
        r"TensorFlow's error, with your names for EPL's copies: Graph execution error:", message)
    assert "EPL_" not in message
    assert not info.value.op.name.startswith("EPL_")


def test_end_of_data_says_how_many_batches_a_step_draws(epl_env):
    with tf.Graph().as_default():
        train = _model(epl_env, batches=4)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            sess.run(train)
            with pytest.raises(tf.errors.OutOfRangeError) as info:
                sess.run(train)
    message = str(info.value.message)
    assert message.startswith(
        "at global step 2: the input ran out of data: IteratorGetNext has no more batches (each "
        "step draws 2 batches from it: one per replica and micro-batch, io.batch_mode "
        "'replica'); repeat the dataset (Dataset.repeat) or stop at "
        "tf.errors.OutOfRangeError. TensorFlow's error, with your names for EPL's copies: "
    ), message
    assert "EPL_" not in message
    assert info.value.op.name == "IteratorGetNext"


# --------------------------------------------------------------------------
# a failure inside a unit function's call (epl/passes/unit_functions.py)
# --------------------------------------------------------------------------

SEQ = 6


def _masked_positions_model(epl_env):
    """A TF1 masked-token model on 2 pipeline stages x 2 micro-batches, fed by
    placeholders: stage 0 encodes the tokens, stage 1 gathers the masked positions'
    vectors as BERT's gather_indexes does (a GatherV2, inside the stage's call) and
    predicts the tokens there. Returns (train op, loss, placeholders)."""
    epl_env({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2})
    import epl
    tokens = tf.compat.v1.placeholder(tf.float32, [ROWS, SEQ, 3], name="tokens")
    positions = tf.compat.v1.placeholder(tf.int32, [ROWS, 2], name="positions")
    labels = tf.compat.v1.placeholder(tf.int32, [ROWS, 2], name="labels")
    with epl.replicate(1, name="encoder"):
        hidden = tf.compat.v1.layers.dense(tokens, 4, activation=tf.nn.tanh, name="encode")
    with epl.replicate(1, name="head"):
        flat = tf.reshape(hidden, [ROWS * SEQ, 4])
        offsets = tf.reshape(tf.range(ROWS) * SEQ, [-1, 1])
        picked = tf.gather(flat, tf.reshape(positions + offsets, [-1]))
        logits = tf.compat.v1.layers.dense(picked, 5, name="predict")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(labels, [-1]), logits=logits))
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return train, loss, (tokens, positions, labels)


def _masked_feed(placeholders, position: int) -> dict:
    tokens, positions, labels = placeholders
    rows = 2 * ROWS   # both micro-batches' rows (io.batch_mode 'replica')
    return {tokens: np.linspace(-1, 1, rows * SEQ * 3, dtype=np.float32).reshape(rows, SEQ, 3),
            positions: np.full([rows, 2], position, np.int32),
            labels: np.ones([rows, 2], np.int32)}


def test_a_failure_inside_a_unit_function_names_the_users_op(epl_env):
    # TensorFlow reports a failure inside a call as the call's body node, or only as
    # the cancellation of the step's other calls ("RecvAsync is cancelled"); the
    # session runs the copies again on the same feeds and raises the failing op's error
    with tf.Graph().as_default() as graph:
        train, loss, placeholders = _masked_positions_model(epl_env)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            assert np.isfinite(sess.run([train, loss], _masked_feed(placeholders, 1))[1])
            assert parallel_graph(graph).unit_outputs   # the step runs calls
            before = sess.run(tf.compat.v1.trainable_variables())
            with pytest.raises(tf.errors.InvalidArgumentError) as info:
                sess.run(train, _masked_feed(placeholders, 100))
            after = sess.run(tf.compat.v1.trainable_variables())
    message = str(info.value.message)
    assert message.startswith("at an unknown global step (it cannot be read): TensorFlow's "
                              "error, with your names for EPL's copies: "), message
    assert re.search(r"indices\[\d+\] = 1\d\d is not in \[0, 24\)", message), message
    assert re.search(r"GatherV2 \(replica 0, micro-batch [01]'s copy\)", message), message
    assert "EPL_" not in message and "RecvAsync" not in message
    for value, old in zip(after, before):   # neither the step nor the rerun updated
        np.testing.assert_array_equal(value, old)


def test_a_cancelled_step_says_what_it_may_hide(epl_env):
    # a cancellation whose copies run again without error (nothing failed in them)
    # changes nothing and says where the failure is; so does one whose copies draw
    # from an iterator, which the session does not run again
    with tf.Graph().as_default() as graph:
        train, _, placeholders = _masked_positions_model(epl_env)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train, _masked_feed(placeholders, 1))
            result = parallel_graph(graph)
            before = sess.run(tf.compat.v1.trainable_variables())
            feed = session_hooks._redirect_feeds(result, _masked_feed(placeholders, 1))
            cancelled = tf.errors.CancelledError(None, None, "RecvAsync is cancelled.")
            found = session_hooks._cause_in_copies(sess, result, cancelled, feed)
            assert session_hooks._rerunnable_copies(result, session_hooks._unit_calls(result))
            np.testing.assert_array_equal(sess.run(tf.compat.v1.trainable_variables())[0],
                                          before[0])
    assert isinstance(found, tf.errors.CancelledError)
    assert found.message == (
        "RecvAsync is cancelled.\nThis step ran EPL's unit functions "
        "(pipeline.unit_functions): when an op inside one of them fails, TensorFlow may "
        "report the cancellation of the others instead of the failure. If nothing else "
        "cancelled the step, TensorFlow's log above names the op that failed (\"Local "
        "rendezvous is aborting with status: ...\"); with pipeline.unit_functions set to "
        "False, this error is that op's.")
    with tf.Graph().as_default() as graph:
        train = _model(epl_env)   # a tf.data input
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            result = parallel_graph(graph)
            assert result.unit_outputs and not session_hooks._rerunnable_copies(result, session_hooks._unit_calls(result))
            found = session_hooks._cause_in_copies(sess, result, cancelled, {})
    assert found.message == (
        "RecvAsync is cancelled.\n" + session_hooks._UNEXPLAINED)


# --------------------------------------------------------------------------
# checkpoints: damaged files (restore) and failed saves
# --------------------------------------------------------------------------


def _train(epl_env, root, last_step, break_at=None, breaker=None):
    """MonitoredTrainingSession with a checkpoint every 3 steps in `root`; at global step
    `break_at`, `breaker()` runs (it breaks the next save)."""
    with tf.Graph().as_default():
        epl_env({"cluster.virtual_devices": 2})
        import epl
        x = tf.compat.v1.placeholder(tf.float32, [ROWS, 3])
        with epl.replicate(1):
            loss = tf.reduce_mean(tf.compat.v1.layers.dense(x, 2, name="out"))
        step = tf.compat.v1.train.get_or_create_global_step()
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)

        class Break(tf.compat.v1.train.SessionRunHook):
            def after_run(self, run_context, run_values):
                if breaker and run_context.session.run(step) == break_at:
                    breaker()

        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=str(root), save_checkpoint_steps=3, save_summaries_steps=None,
                save_summaries_secs=None, log_step_count_steps=None,
                hooks=[tf.compat.v1.train.StopAtStepHook(last_step=last_step), Break()]) as sess:
            while not sess.should_stop():
                sess.run(train, {x: np.ones([2 * ROWS, 3])})


@pytest.fixture
def checkpoints(epl_env, tmp_path):
    """A directory with EPL's checkpoints of steps 0 and 3."""
    root = tmp_path / "ckpt"
    _train(epl_env, root, 3)
    return root


DAMAGE = {
    "truncated data": (".data-00000-of-00001", lambda p: os.truncate(p, 10),
                       "its data file {p}.data-00000-of-00001 (10 bytes) is shorter than its "
                       "index says: variable out/bias lies past its end (cut short: the save did "
                       "not finish, or the file was truncated; TensorFlow: Read less bytes than "
                       "requested)"),
    "garbage index": (".index", lambda p: open(p, "wb").write(b"not a checkpoint index" * 20),
                      "its index file {p}.index is not a checkpoint index: it is damaged, or "
                      "another file (TensorFlow: not an sstable (bad magic number))"),
    "short index": (".index", lambda p: os.truncate(p, 20),
                    "its index file {p}.index is cut short (20 bytes; TensorFlow: file is too "
                    "short to be an sstable)"),
    "deleted data": (".data-00000-of-00001", os.remove,
                     "its data file {p}.data-00000-of-... is missing (deleted?)"),
    "deleted index": (".index", os.remove,
                      "its index file {p}.index is missing (deleted, or the save did not "
                      "finish)"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_checkpoint_is_named_with_its_file_and_what_is_wrong(epl_env, checkpoints,
                                                                     kind):
    suffix, damage_it, problem = DAMAGE[kind]
    prefix = str(checkpoints / "model.ckpt-3")
    damage_it(prefix + suffix)
    assert diagnose(prefix) == problem.format(p=prefix)
    with pytest.raises(CheckpointError) as info:
        _train(epl_env, checkpoints, 6)
    assert str(info.value) == (
        "cannot restore the checkpoint %s: %s. An older checkpoint in %s is intact: %s; to "
        "resume from it, name it as model_checkpoint_path in %s." % (
            prefix, problem.format(p=prefix), checkpoints, checkpoints / "model.ckpt-0",
            checkpoints / "checkpoint"))
    assert last_good(str(checkpoints)) == str(checkpoints / "model.ckpt-0")


def test_intact_checkpoint_has_nothing_wrong(checkpoints):
    assert diagnose(str(checkpoints / "model.ckpt-3")) is None
    assert last_good(str(checkpoints)) == str(checkpoints / "model.ckpt-3")


def test_save_that_runs_out_of_quota_names_the_path_and_keeps_the_last_good_one(tmp_path):
    """A quota that runs out after the first save (tests/workers/checkpoint_worker.py,
    SAVE_FAULT: no file of the process may grow past 100 bytes): the second save (step
    10) cannot write. TensorFlow says OutOfRangeError ("File too large"), which
    MonitoredTrainingSession would take for the end of the data, ending the job as if
    training had finished; EPL ends it with the path and the reason instead, and the
    checkpoint of step 5 stays the last one, intact."""
    out, root = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    job = run_job([sys.executable, worker_script("checkpoint_worker.py"), "rank0", str(out),
                   str(root)], 300, env={"SAVE_FAULT": "quota@7"})
    assert job.returncode == 1, job.stdout[-3000:]
    errors = [line for line in job.text if line.startswith("epl.errors.CheckpointError: ")]
    assert len(errors) == 1, job.stdout[-3000:]
    assert re.fullmatch(
        r"epl\.errors\.CheckpointError: at global step 10: saving the checkpoint %s failed: a "
        r"file-size limit was reached \(a quota; TensorFlow: %s_temp/part-00000-of-00001\.[\w.-]+\."
        r"tempstate\d+; File too large\)\. The last good checkpoint, %s, is intact \(%s names "
        r"it\): a restarted job resumes from it\." % tuple(re.escape(str(p)) for p in (
            root / "model.ckpt-10", root / "model.ckpt-10", root / "model.ckpt-5",
            root / "checkpoint")), errors[0]), errors[0]
    assert tf.train.latest_checkpoint(str(root)) == str(root / "model.ckpt-5")
    assert diagnose(str(root / "model.ckpt-5")) is None
    assert not list(out.iterdir())  # it did not end as if it had finished


def test_save_into_a_removed_directory_names_it(epl_env, tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as info:
        _train(epl_env, root, 9, break_at=4, breaker=lambda: shutil.rmtree(root))
    assert str(info.value) == (
        "at global step 6: saving the checkpoint %s failed: its directory %s no longer exists "
        "(TensorFlow: %s_temp; No such file or directory). No intact checkpoint is left in %s."
        % (root / "model.ckpt-6", root, root / "model.ckpt-6", root))


def test_a_short_last_batch_is_logged_with_the_rows_dropped(epl_env, caplog):
    """A dataset without drop_remainder whose last batch is short (10 rows in batches of
    4: 4, 4, 2): the second step's second replica finds no batch; the error is the end of
    the input (MonitoredTrainingSession stops on it), and the 2 rows the step drops are
    logged."""
    epl_env({"cluster.virtual_devices": 2})
    with tf.Graph().as_default():
        data = np.arange(30, dtype=np.float32).reshape(10, 3)
        x = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices(data).batch(4)).get_next()
        import epl
        with epl.replicate(1):
            w = tf.compat.v1.get_variable("w", [3, 1])
            loss = tf.reduce_mean(tf.matmul(x, w))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        with tf.compat.v1.Session() as sess, caplog.at_level("WARNING", logger="epl"):
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            with pytest.raises(tf.errors.OutOfRangeError) as info:
                sess.run(train)
    said = ("the input ran out of data within a step: unit 1 of the 2 units (replicas x "
            "micro-batches) of this step found no batch, so the 2 row(s) the units before it "
            "drew are dropped and the step does not run (EPL runs whole steps: use "
            "Dataset.batch(..., drop_remainder=True) and a number of batches divisible by 2 "
            "to drop nothing). ")
    assert str(info.value.message).startswith("at global step 1: " + said)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "at global step 1: " + said]
