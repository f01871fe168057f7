"""Train a 100,000-class classifier whose weights are split over 4 devices.

Whale's large-scale classification case: the feature extractor is small and
data-parallel (`epl.replicate`), the classifier is huge and split by classes
(`epl.split`). Each device holds a quarter of the classifier (and of its Adam
slots); the features of every replica are all-gathered, each device computes
the logits of its classes for the whole global batch, and the softmax
cross-entropy is computed from a distributed max and sum of exponentials, so
the [batch, 100000] logits are never gathered on one device.

Before training the script prints each device's share of the classifier and
what the unsplit classifier would need on one device, against a per-device
memory budget (`--device-memory-mb`, standing for a small accelerator).

The data are synthetic with a learnable signal: class c's examples are noisy
copies of a random prototype, and labels follow a Zipf law (a few classes are
frequent), so the loss falls well below log(100000) = 11.5.

    python examples/large_classifier.py [--steps 60] [--batch 32] [--classes 100000]
"""
import argparse

from epl.observability.logs import quiet_tensorflow_startup


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32,
                        help="one replica's batch (a step trains on devices x batch examples)")
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--devices", type=int, default=None,
                        help="virtual CPU devices (CPU only; default: cluster.virtual_devices, "
                             "e.g. 4, or epl-launch --virtual-devices)")
    parser.add_argument("--device-memory-mb", type=float, default=48.0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--logdir", help="TensorBoard directory (graph, samples/sec, loss)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()   # --help and bad options answer here, before TensorFlow is imported

with quiet_tensorflow_startup():
    import numpy as np
    import tensorflow as tf

import epl  # noqa: E402
import epl.layers as layers  # noqa: E402
from epl.observability.progress import ProgressHook  # noqa: E402
from epl.observability.summary import JobBatch  # noqa: E402


FEATURES, HIDDEN = 32, 64


def synthetic_dataset(classes: int, batch_size: int, seed: int = 0) -> tf.data.Dataset:
    """Endless (features, label) batches: Zipf labels, noisy class prototypes."""
    rng = np.random.RandomState(seed)
    examples = 20000
    labels = np.minimum(rng.zipf(1.3, size=examples) - 1, classes - 1).astype(np.int64)
    prototypes = rng.randn(int(labels.max()) + 1, FEATURES).astype(np.float32)
    features = prototypes[labels] + 0.5 * rng.randn(examples, FEATURES).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    return dataset.shuffle(examples, seed=seed).repeat().batch(batch_size, drop_remainder=True)


def report_memory(graph: tf.Graph, classes: int, budget_mb: float) -> None:
    """Per-device bytes of the classifier's weights and Adam slots, from the placed graph."""
    per_device: dict = {}
    for variable in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
        info = getattr(variable, "_save_slice_info", None)
        if info is not None and info.full_name.startswith("classifier"):
            nbytes = variable.shape.num_elements() * variable.dtype.size
            per_device[variable.device] = per_device.get(variable.device, 0) + nbytes
    whole = (HIDDEN * classes + classes) * 4 * 4   # weights, gradients, two Adam slots
    print(f"unsplit classifier on one device: {whole / 2**20:.1f} MB (weights, gradients, "
          f"Adam slots) against a {budget_mb:.0f} MB budget: "
          f"{'fits' if whole <= budget_mb * 2**20 else 'does NOT fit'}")
    for device, nbytes in sorted(per_device.items()):
        shard = nbytes * 4 / 3   # + the shard's gradient (same size as the weights)
        print(f"  {device}: classifier shard {shard / 2**20:.1f} MB "
              f"({'fits' if shard <= budget_mb * 2**20 else 'does NOT fit'})")


def main(argv=None) -> None:
    args = parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    config = {"cluster.colocate_split_and_replicate": True, "debug.log_level": "INFO"}
    if args.devices is not None:
        config["cluster.virtual_devices"] = args.devices
    epl.init(epl.Config(config))
    cluster = epl.Env.get().cluster
    args.devices = cluster.gpu_num_per_worker   # this worker's devices
    batch = JobBatch(cluster.worker_num, args.devices, 1, "replica", args.batch)
    rank0 = cluster.worker_index == 0
    if rank0:
        print(f"large_classifier: {args.classes} classes, {args.steps} steps, global batch "
              f"{batch.describe()}; building the graph", flush=True)

    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        synthetic_dataset(args.classes, args.batch)).get_next()
    with epl.replicate(device_count=1):
        hidden = layers.dense(features, HIDDEN, activation=tf.nn.relu, name="body")
    with epl.split(device_count=args.devices):
        logits = layers.dense(hidden, args.classes, name="classifier")
        loss = layers.sparse_softmax_cross_entropy(labels, logits)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.AdamOptimizer(1e-2).minimize(loss, global_step=global_step)
    if rank0:
        report_memory(tf.compat.v1.get_default_graph(), args.classes, args.device_memory_mb)

    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=args.steps),
             ProgressHook(batch_size=args.batch, tensors={"loss": loss},
                          every_n_steps=args.log_every, last_step=args.steps,
                          output_dir=args.logdir)]
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run(train_op)


if __name__ == "__main__":
    main()
