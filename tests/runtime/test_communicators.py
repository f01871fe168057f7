"""LocalCommunicator: every collective among virtual CPU devices gives the right values."""
import numpy as np
import tensorflow as tf

from epl.runtime.communicators import LocalCommunicator

DEVICES = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]


def _run(build):
    with tf.Graph().as_default():
        inputs = [np.arange(6, dtype=np.float32).reshape(6, 1) * (i + 1) for i in range(3)]
        tensors = []
        for value, device in zip(inputs, DEVICES):
            with tf.device(device):
                tensors.append(tf.constant(value))
        outputs = build(LocalCommunicator(timeout_s=30), tensors)
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 3})
        with tf.compat.v1.Session(config=config) as sess:
            return inputs, sess.run(outputs)


# Every member of a collective must run (fetch all outputs), or the others wait.
def test_all_reduce_sum_and_mean():
    inputs, outs = _run(lambda c, t: c.all_reduce(t, DEVICES, "sum") + c.all_reduce(t, DEVICES, "mean"))
    for out in outs[:3]:
        np.testing.assert_allclose(out, sum(inputs))
    for out in outs[3:]:
        np.testing.assert_allclose(out, sum(inputs) / 3)


def test_all_gather_and_broadcast():
    inputs, outs = _run(lambda c, t: c.all_gather(t, DEVICES) + c.broadcast(t[0], DEVICES))
    for out in outs[:3]:
        np.testing.assert_allclose(out, np.concatenate(inputs))
    for out in outs[3:]:
        np.testing.assert_allclose(out, inputs[0])


def test_reduce_scatter_and_all_to_all():
    inputs, outs = _run(lambda c, t: c.reduce_scatter(t, DEVICES) + c.all_to_all(t, DEVICES))
    total = sum(inputs)
    for i in range(3):
        np.testing.assert_allclose(outs[i], total[2 * i:2 * i + 2])
        np.testing.assert_allclose(outs[3 + i], np.concatenate([x[2 * i:2 * i + 2] for x in inputs]))
