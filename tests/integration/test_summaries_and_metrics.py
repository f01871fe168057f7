"""Summaries and merged fetches are the job's values, not replica 0's.

A scalar, histogram, image or text summary of a tensor in GLOBAL_MEAN_OBJECTS /
GLOBAL_SUM_OBJECTS / GLOBAL_CONCAT_OBJECTS reads its merge over every replica and
micro-batch; tf.compat.v1.metrics (their update and value ops, also in
GLOBAL_MEAN_OBJECTS, also summarized) accumulate every unit's batch. Each is checked
against single-device training on the concatenated batch (EPL's collections_test
and summary tests, written as a classifier script).
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env

B, FEATURES, CLASSES, STEPS = 4, 3, 3, 2
RNG = np.random.RandomState(3)
X = RNG.randn(32, FEATURES).astype(np.float32)
LABELS = RNG.randint(0, CLASSES, 32).astype(np.int64)
LAYOUTS = {"dp": {"cluster.virtual_devices": 2},
           "micro_batches": {"cluster.virtual_devices": 1, "pipeline.num_micro_batch": 2}}
UNITS = 2


def _script(rows: int, collect: bool, resource: bool = True):
    x = tf.compat.v1.placeholder(tf.float32, [rows, FEATURES], name="x")
    labels = tf.compat.v1.placeholder(tf.int64, [rows], name="labels")
    logits = tf.compat.v1.layers.dense(x, CLASSES, name="logits",
                                       kernel_initializer=tf.constant_initializer(0.3))
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    loss = tf.reduce_mean(per_example)
    confidence = tf.reduce_mean(tf.reduce_max(tf.nn.softmax(logits), axis=1))
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    images = tf.reshape(x, [rows, 1, FEATURES, 1])
    words = tf.strings.as_string(labels)
    with tf.compat.v1.variable_scope("metrics", use_resource=resource):   # reference variables
        accuracy, accuracy_update = tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1))
        mean_loss, mean_loss_update = tf.compat.v1.metrics.mean(per_example)
    if collect:
        epl.add_to_collection([confidence, accuracy_update], epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
        epl.add_to_collection(correct, epl.GraphKeys.GLOBAL_SUM_OBJECTS)
        epl.add_to_collection([logits, images, words], epl.GraphKeys.GLOBAL_CONCAT_OBJECTS)
    tf.compat.v1.summary.scalar("loss", loss)
    tf.compat.v1.summary.scalar("confidence", confidence)
    tf.compat.v1.summary.scalar("correct", correct)
    tf.compat.v1.summary.scalar("accuracy_update", accuracy_update)
    tf.compat.v1.summary.histogram("logits", logits)
    tf.compat.v1.summary.image("images", images, max_outputs=64)
    tf.compat.v1.summary.text("words", words)
    summaries = tf.compat.v1.summary.merge_all()
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    fetches = {"summary": summaries, "accuracy_update": accuracy_update,
               "mean_loss_update": mean_loss_update, "confidence": confidence,
               "correct": correct, "train": train_op}
    return x, labels, fetches, {"accuracy": accuracy, "mean_loss": mean_loss}


def _values(serialized: bytes) -> dict:
    """{tag: what the summary holds}: a scalar, a histogram's (count, sum, min, max), an
    image summary's image count, a text summary's strings."""
    summary = tf.compat.v1.Summary.FromString(serialized)
    out = {}
    for value in summary.value:
        kind = value.WhichOneof("value")
        if kind == "simple_value":
            out[value.tag] = value.simple_value
        elif kind == "histo":
            out[value.tag] = (value.histo.num, value.histo.sum, value.histo.min, value.histo.max)
        elif kind == "image":
            out[value.tag.rsplit("/", 2)[0]] = out.get(value.tag.rsplit("/", 2)[0], 0) + 1
        elif kind == "tensor":
            out[value.tag] = tuple(tf.make_ndarray(value.tensor).ravel().tolist())
    return out


def _run(config: dict | None, resource: bool = True):
    env.reset()
    units = 1
    if config is not None:
        epl.init(epl.Config(dict(config)))
        units = UNITS
    rows = UNITS * B // units
    with tf.Graph().as_default():
        x, labels, fetches, values = _script(rows, config is not None, resource)
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])
            steps = []
            for i in range(STEPS):
                feed = {x: X[i * UNITS * B:(i + 1) * UNITS * B],
                        labels: LABELS[i * UNITS * B:(i + 1) * UNITS * B]}
                result = sess.run(fetches, feed)
                result["summary"] = _values(result["summary"])
                del result["train"]
                steps.append(result)
            return steps, sess.run(values)


@pytest.mark.parametrize("layout,resource", [("dp", True), ("micro_batches", True),
                                             ("dp", False)])
def test_summaries_merged_fetches_and_metrics_are_the_global_batchs(layout, resource):
    """resource False: the metrics' variables are reference variables (TF1 scripts
    that disable resource variables): their update op reads the AssignAdd's ref."""
    reference_steps, reference_values = _run(None, resource)
    steps, values = _run(LAYOUTS[layout], resource)
    for step, (result, reference) in enumerate(zip(steps, reference_steps)):
        assert sorted(result["summary"]) == sorted(reference["summary"])
        for tag, expected in reference["summary"].items():
            got = result["summary"][tag]
            if isinstance(expected, tuple) and expected and isinstance(expected[0], bytes):
                assert got == expected, (step, tag)
            else:
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6,
                                           err_msg=f"step {step}, summary {tag}")
        for key in ("accuracy_update", "mean_loss_update", "confidence", "correct"):
            np.testing.assert_allclose(result[key], reference[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step}, {key}")
    for key, expected in reference_values.items():
        np.testing.assert_allclose(values[key], expected, rtol=1e-5, err_msg=key)
