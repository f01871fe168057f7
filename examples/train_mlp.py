"""Train an MLP classifier with EPL data parallelism over 4 (virtual) devices.

An ordinary tf.compat.v1 training script: a tf.data input pipeline, a model,
an optimizer, MonitoredTrainingSession. The only EPL lines are `epl.init` and
the `epl.replicate` scope. On a CPU-only machine EPL creates
`cluster.virtual_devices` virtual CPU devices and runs one replica on each.
As in EPL, the script's batch (`--batch`) is one replica's batch: every
replica draws its own batch from the input pipeline, so one step trains on
devices x batch examples (the global batch); gradients are all-reduced, and
the printed loss is the mean over the whole global batch.

The data are synthetic with a learnable signal: each class has a random
prototype in feature space and examples are noisy copies of their class's
prototype, so the loss falls well below log(num_classes).

    python examples/train_mlp.py [--steps 200] [--batch 64] [--devices 4] [--logdir DIR]

Output: a first line at once, EPL's summary of the parallel graph (logged at
INFO), then the step, the loss and samples/s every --log-every steps and at
the last step, and an end summary (epl.observability.progress.ProgressHook),
as numbers of the job: under several workers (epl-launch -np 2) worker 0
prints them for all (global batch = workers x replicas x batch). With
--logdir, TensorBoard shows the parallel graph, samples/sec, global_step/sec
and the loss.
"""
import argparse

from epl.observability.logs import quiet_tensorflow_startup


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64,
                        help="one replica's batch (a step trains on devices x batch examples)")
    parser.add_argument("--devices", type=int, default=None,
                        help="virtual CPU devices (CPU only; default: cluster.virtual_devices, "
                             "e.g. 4, or epl-launch --virtual-devices)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--logdir", help="TensorBoard directory (graph, samples/sec, loss)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()   # --help and bad options answer here, before TensorFlow is imported

with quiet_tensorflow_startup():
    import numpy as np
    import tensorflow as tf

import epl  # noqa: E402
from epl.observability.progress import ProgressHook  # noqa: E402
from epl.observability.summary import JobBatch  # noqa: E402

FEATURES, CLASSES, HIDDEN = 64, 10, 256


def synthetic_dataset(batch_size: int, seed: int = 0) -> tf.data.Dataset:
    """An endless stream of (features, label) batches with a learnable signal."""
    rng = np.random.RandomState(seed)
    prototypes = rng.randn(CLASSES, FEATURES).astype(np.float32)
    labels = rng.randint(0, CLASSES, size=20000).astype(np.int64)
    features = prototypes[labels] + 4.0 * rng.randn(20000, FEATURES).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    return dataset.shuffle(20000, seed=seed).repeat().batch(batch_size, drop_remainder=True)


def dense(inputs: tf.Tensor, units: int, name: str, activation=None) -> tf.Tensor:
    """A fully connected layer from raw ops (no Keras needed)."""
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [inputs.shape[-1], units],
            initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.compat.v1.zeros_initializer())
        outputs = tf.matmul(inputs, kernel) + bias
    return activation(outputs) if activation else outputs


def main(argv=None) -> ProgressHook:
    """Train; print progress; return the ProgressHook (its last step and values)."""
    args = parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    config = {"debug.log_level": "INFO"}
    if args.devices is not None:
        config["cluster.virtual_devices"] = args.devices
    epl.init(epl.Config(config))
    cluster = epl.Env.get().cluster
    batch = JobBatch(cluster.worker_num, cluster.gpu_num_per_worker, 1, "replica", args.batch)
    if cluster.worker_index == 0:
        print(f"train_mlp: {args.steps} steps, global batch {batch.describe()}; building the "
              "graph", flush=True)

    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        synthetic_dataset(args.batch)).get_next()
    with epl.replicate(device_count=1):
        hidden = dense(features, HIDDEN, "hidden1", tf.nn.relu)
        hidden = dense(hidden, HIDDEN, "hidden2", tf.nn.relu)
        logits = dense(hidden, CLASSES, "logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss, global_step=global_step)

    progress = ProgressHook(batch_size=args.batch, tensors={"loss": loss},
                            every_n_steps=args.log_every, last_step=args.steps,
                            output_dir=args.logdir)
    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=args.steps), progress]
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run(train_op)
    return progress


if __name__ == "__main__":
    main()
