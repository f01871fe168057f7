"""Train M6-mini: a multimodal mixture-of-experts transformer, experts split over 4 devices.

A scaled-down M6 (Lin et al. 2021, trained with Whale): image patches and
text tokens go through one transformer whose feed-forward layers are
mixtures of experts (top-2 gating, a capacity factor and the load-balancing
loss). It is an ordinary tf.compat.v1 training script plus the EPL lines:
- `epl.set_default_strategy(epl.replicate(1))`: everything is data-parallel
  (one replica per device, each drawing its own batch of --batch examples);
- `epl.layers.moe(..., split_devices=4)` creates each layer's experts under
  `epl.split(4)`: each device holds 2 of the 8 experts, and each replica's
  tokens travel to their experts' devices and back by all-to-all.

The task is image captioning on synthetic image-text pairs with a learnable
relation: an image is a noisy copy of one of 32 class prototypes (16 patches
of 48 values), and its caption is 8 tokens determined by the class. The model
reads the patches and predicts each caption token from the image and the
previous tokens (a prefix language model), so the loss falls from log(128)
= 4.85 only by learning the image-text relation.

    python examples/m6_mini.py [--steps 120] [--batch 8] [--devices 4]
"""
import argparse

from epl.observability.logs import quiet_tensorflow_startup


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=8,
                        help="one replica's batch (a step trains on devices x batch examples)")
    parser.add_argument("--devices", type=int, default=None,
                        help="virtual CPU devices (CPU only; default: cluster.virtual_devices, "
                             "e.g. 4, or epl-launch --virtual-devices)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--logdir", help="TensorBoard directory (graph, samples/sec, losses)")
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


PATCHES, PATCH_DIM = 16, 48
TEXT, VOCAB, CLASSES = 8, 128, 32
D_MODEL, HEADS, LAYERS = 64, 4, 2
EXPERTS, EXPERT_HIDDEN = 8, 128


def synthetic_pairs(batch_size: int, seed: int = 0) -> tf.data.Dataset:
    """Endless (patches, caption) batches; the caption is a function of the image's class."""
    rng = np.random.RandomState(seed)
    examples = 8192
    prototypes = rng.randn(CLASSES, PATCHES, PATCH_DIM).astype(np.float32)
    captions_of = (np.arange(CLASSES)[:, None] * 7 + np.arange(TEXT)[None, :] * 13) % (VOCAB - 1) + 1
    classes = rng.randint(0, CLASSES, size=examples)
    patches = prototypes[classes] + 0.8 * rng.randn(examples, PATCHES, PATCH_DIM).astype(np.float32)
    captions = captions_of[classes].astype(np.int32)
    dataset = tf.data.Dataset.from_tensor_slices((patches, captions))
    return dataset.shuffle(examples, seed=seed).repeat().batch(batch_size, drop_remainder=True)


def layer_norm(x: tf.Tensor, name: str) -> tf.Tensor:
    with tf.compat.v1.variable_scope(name):
        gamma = tf.compat.v1.get_variable("gamma", [x.shape[-1]], initializer=tf.ones_initializer())
        beta = tf.compat.v1.get_variable("beta", [x.shape[-1]], initializer=tf.zeros_initializer())
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta


def attention(x: tf.Tensor, mask: tf.Tensor, name: str) -> tf.Tensor:
    """Multi-head self-attention; mask [L, L] is 1 where a position may attend."""
    length = int(x.shape[1])
    with tf.compat.v1.variable_scope(name):
        qkv = layers.dense(x, 3 * D_MODEL, name="qkv")
        q, k, v = tf.split(qkv, 3, axis=-1)

        def heads(t):   # [B, L, D] -> [B, H, L, D/H]
            return tf.transpose(tf.reshape(t, [-1, length, HEADS, D_MODEL // HEADS]), [0, 2, 1, 3])

        scores = tf.matmul(heads(q), heads(k), transpose_b=True) / float(D_MODEL // HEADS) ** 0.5
        scores += (1.0 - mask) * -1e9
        context = tf.matmul(tf.nn.softmax(scores, axis=-1), heads(v))
        context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [-1, length, D_MODEL])
        return layers.dense(context, D_MODEL, name="out")


def prefix_lm_mask() -> tf.Tensor:
    """Image positions see the image; text position t sees the image and text <= t."""
    length = PATCHES + TEXT
    mask = np.zeros([length, length], np.float32)
    mask[:, :PATCHES] = 1.0
    mask[PATCHES:, PATCHES:] = np.tril(np.ones([TEXT, TEXT], np.float32))
    return tf.constant(mask)


def m6_mini(patches: tf.Tensor, captions: tf.Tensor, split_devices: int):
    """Returns (caption loss, load-balancing loss)."""
    image = layers.dense(patches, D_MODEL, name="patch_embedding")
    inputs = tf.concat([tf.zeros_like(captions[:, :1]), captions[:, :-1]], axis=1)  # shift right
    text = layers.embedding(inputs, VOCAB, D_MODEL, name="token_embedding")
    x = tf.concat([image, text], axis=1)
    position = tf.compat.v1.get_variable("position", [PATCHES + TEXT, D_MODEL],
                                         initializer=tf.random_normal_initializer(stddev=0.02))
    x = x + position
    mask = prefix_lm_mask()
    aux_losses = []
    for index in range(LAYERS):
        with tf.compat.v1.variable_scope(f"layer_{index}"):
            x = x + attention(layer_norm(x, "ln_attention"), mask, "attention")
            ffn, aux = layers.moe(layer_norm(x, "ln_moe"), EXPERTS, EXPERT_HIDDEN, k=2,
                                  capacity_factor=1.25, split_devices=split_devices)
            x = x + ffn
            aux_losses.append(aux)
    x = layer_norm(x, "ln_final")
    logits = layers.dense(x[:, PATCHES:], VOCAB, name="lm_head")
    caption_loss = layers.sparse_softmax_cross_entropy(captions, logits)
    return caption_loss, tf.add_n(aux_losses) / LAYERS


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
    if cluster.worker_index == 0:
        print(f"m6_mini: {LAYERS} layers, {EXPERTS} experts, {args.steps} steps, global batch "
              f"{batch.describe()}; building the graph", flush=True)
    epl.set_default_strategy(epl.replicate(device_count=1))

    patches, captions = tf.compat.v1.data.make_one_shot_iterator(
        synthetic_pairs(args.batch)).get_next()
    caption_loss, balance_loss = m6_mini(patches, captions, split_devices=args.devices)
    loss = caption_loss + 0.01 * balance_loss
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.AdamOptimizer(2e-3).minimize(loss, global_step=global_step)

    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=args.steps),
             ProgressHook(batch_size=args.batch,
                          tensors={"caption loss": caption_loss, "balance loss": balance_loss},
                          every_n_steps=args.log_every, last_step=args.steps,
                          output_dir=args.logdir)]
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run(train_op)


if __name__ == "__main__":
    main()
