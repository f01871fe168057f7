"""ZeRO stage 1 (zero.level "v1"): the oracle, optimizer-state bytes per replica, bad input.

The oracle: k steps with the optimizer state sharded over the replicas give the
same variables (parameters and, read back through the checkpoint copies, the
optimizer slots) and losses as single-device training.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.errors import PassError
from epl.passes.zero import optimizer_state_bytes

STEPS = 5
TIMEOUT = {"communication.collective_timeout_s": 60}  # a bug fails fast instead of hanging


@pytest.mark.parametrize("model,optimizer,replicas,micro", [
    ("mlp", "sgd", 2, 1),
    ("mlp", "adam", 4, 1),
    ("transformer", "adam", 2, 1),
    ("mlp", "adam", 2, 2),      # gradient accumulation
    ("transformer", "sgd", 4, 2),
])
def test_zero_matches_single_device(models, epl_env, model, optimizer, replicas, micro):
    reference = models.single_device(model=model, optimizer=optimizer)
    epl_env({**TIMEOUT, "cluster.virtual_devices": replicas, "zero.level": "v1",
             "pipeline.num_micro_batch": micro, "debug.check_invariants": True})
    result = models.train(STEPS, model=model, optimizer=optimizer)
    models.assert_same_training(result, reference)


def test_zero_uneven_shares_match_single_device(models, epl_env):
    reference = models.single_device(model="mlp", optimizer="adam")
    epl_env({**TIMEOUT, "cluster.virtual_devices": 2, "zero.level": "v1",
             "io.batch_mode": "global"})   # uneven shares slice one batch
    result = models.train(STEPS, replica_weights=[3, 1], model="mlp", optimizer="adam")
    models.assert_same_training(result, reference)


def _state_bytes(epl_env, models, config, replicas):
    epl_env(dict(config, **{"cluster.virtual_devices": replicas}))
    with tf.Graph().as_default() as graph:
        built = models.build("mlp", "adam")
        epl.parallelize(graph)
        return optimizer_state_bytes(graph, [built.train_op])


@pytest.mark.parametrize("replicas", [2, 4])
def test_optimizer_state_per_replica_is_one_nth(models, epl_env, replicas):
    params = sum(v.size for v in models.make_params("mlp").values())
    replicated = _state_bytes(epl_env, models, {}, replicas)
    sharded = _state_bytes(epl_env, models, {"zero.level": "v1"}, replicas)
    devices = [f"/device:CPU:{k}" for k in range(replicas)]
    # Adam: two moments of 4-byte floats per parameter, on every replica
    assert replicated == {d: 2 * 4 * params for d in devices}
    # every MLP variable's size divides by 2 and 4: no padding, exactly 1/N
    assert sharded == {d: 2 * 4 * params // replicas for d in devices}


def _clipped_step(clip: str, use_epl: bool, epl_env, steps: int = 3):
    """Adam on gradients clipped per tensor (tf.clip_by_norm) or by their global norm;
    (losses, w) after `steps` steps of 2 x 4 rows."""
    env.reset()
    if use_epl:
        epl_env({"cluster.virtual_devices": 2, "zero.level": "v1"})
    data = np.random.RandomState(1).randn(8 * steps, 3).astype(np.float32)
    rows = 4 if use_epl else 8
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [rows, 3])
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 1]), use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        opt = tf.compat.v1.train.AdamOptimizer(0.1)
        grads, variables = zip(*opt.compute_gradients(loss))
        if clip == "per_tensor":
            clipped = [tf.clip_by_norm(g, 0.5) for g in grads]
        else:
            clipped, _ = tf.clip_by_global_norm(grads, 0.5)
        train_op = opt.apply_gradients(zip(clipped, variables))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([train_op, loss], {x: data[i * 8:(i + 1) * 8]})[1]
                      for i in range(steps)]
            return losses, sess.run(w)


def test_zero_refuses_processing_it_cannot_shard_and_its_remedy_works(epl_env):
    """Clipping each gradient by its own norm sums over some axes only (keep_dims): ZeRO
    names the op and the remedy; the remedy (clip_by_global_norm, whose squared norms
    ZeRO sums over the replicas' shards) equals single-device training."""
    with pytest.raises(PassError) as err:
        _clipped_step("per_tensor", True, epl_env)
    assert str(err.value) == (
        "pass 'zero' rejected the graph before any rewrite: zero.level 'v1' cannot shard "
        "clip_by_norm/Sum (Sum) in the update of w: ZeRO computes the gradient processing and "
        "the update on 1/N of each variable, element by element, and sums over the replicas "
        "only what adds up over elements (the squared norms of clip_by_global_norm). Compute "
        "the processing from those (tf.clip_by_global_norm, scaling by a scalar), or turn ZeRO "
        "off (zero.level '').")
    reference = _clipped_step("global", False, epl_env)
    result = _clipped_step("global", True, epl_env)
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result[1], reference[1], rtol=1e-5, atol=1e-6)


def test_zero_with_reference_variables_is_refused(models, epl_env):
    epl_env({"cluster.virtual_devices": 2, "zero.level": "v1"})
    with tf.Graph().as_default() as graph:
        models.build("mlp", "adam", use_resource=False)
        with pytest.raises(PassError, match="zero.level 'v1' needs resource variables, but w1 is a "
                                            "reference variable \\(VariableV2\\)"):
            epl.parallelize(graph)


def test_checkpoint_holds_full_slots_and_restores(models, epl_env, tmp_path):
    """Save under ZeRO (shards gathered into the single-device names), restore in a
    plain single-device graph: the Adam moments are those of single-device training."""
    reference = models.single_device(model="mlp", optimizer="adam")
    epl_env({**TIMEOUT, "cluster.virtual_devices": 2, "zero.level": "v1"})
    with tf.Graph().as_default():
        built = models.build("mlp", "adam")
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(5):
                sess.run(built.train_op, built.feed)
            path = saver.save(sess, str(tmp_path / "ckpt"))
    epl.env.reset()
    with tf.Graph().as_default() as graph:
        models.build("mlp", "adam")
        with tf.compat.v1.Session() as sess:
            tf.compat.v1.train.Saver().restore(sess, path)
            restored = models.variable_values(sess, graph)
    for name, value in reference.variables.items():
        assert restored[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.multiworker
@pytest.mark.parametrize("sizes", ["8,8", "12,4"])
def test_zero_two_workers_match_single_device(tmp_path, sizes):
    """2 workers x 2 devices: Adam's state in 4 shards, Horovod reduce-scatter/all-gather."""
    from multiworker import errors as _errors, horovodrun as _horovodrun
    result = _horovodrun("zero_worker.py", "adam", sizes, str(tmp_path))
    assert result.returncode == 0, _errors(result.stdout + result.stderr)
    params = 6 * 8 + 8 + 8 * 3  # the worker's MLP
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        np.testing.assert_allclose(record["losses"], record["ref_losses"], rtol=1e-5)
        assert max(record["errors"].values()) < 1e-4, record["errors"]
        assert record["state_bytes"] == {f"/device:CPU:{d}": 2 * 4 * params // 4 for d in (0, 1)}


def test_zero_with_pipeline_stages_matches_single_device(epl_env):
    """2 stages x 2 pipelines, 2 micro-batches: each stage's Adam state is sharded
    over that stage's two devices (and the checkpoint copies sit on the host)."""
    from test_pipeline import assert_same, reference, train_encoder
    expected = reference(4, "adam")
    epl_env({**TIMEOUT, "cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2,
             "zero.level": "v1", "debug.check_invariants": True})
    assert_same(train_encoder(layers=4, stages=2, optimizer="adam"), expected)


def test_zero_with_apply_groups_matches_single_device(models, epl_env):
    reference = models.single_device(model="mlp", optimizer="adam")
    epl_env({**TIMEOUT, "cluster.virtual_devices": 2, "zero.level": "v1",
             "optimizer.num_apply_group": 3, "debug.check_invariants": True})
    models.assert_same_training(models.train(STEPS, model="mlp", optimizer="adam"), reference)
