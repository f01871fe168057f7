"""Train a BERT-style encoder with a 2-stage EPL pipeline (masked-token prediction).

An ordinary tf.compat.v1 training script: a tf.data input pipeline, token and
position embeddings, N transformer layers (multi-head self-attention, GELU
MLP, pre-layer-norm), a masked-token head, an optimizer and
MonitoredTrainingSession. The EPL lines are `epl.init` and the two
`epl.replicate(device_count=1, name="stage_<i>")` scopes: the embeddings and
the first half of the layers are stage 0, the rest and the head stage 1.

EPL runs each stage on its own device. As in EPL, the script's batch
(`--batch`) is one micro-batch of one pipeline: every step draws
`pipeline.num_micro_batch` of them per pipeline from the input pipeline, runs
them through the stages in the `pipeline.strategy` schedule (1F1B by
default), accumulates the gradients over the micro-batches and applies them
once per step. With more devices than stages (`--devices 4`), the pipeline is
replicated: 2 pipelines of 2 stages, each drawing its own micro-batches, with
no change to the script.

The data are synthetic with a learnable signal: every sequence draws its
tokens from one group of 8 consecutive token ids (its "topic"), each token
written twice in a row ("a a b b c c ..."), and a fixed number of positions
per sequence is replaced by the [MASK] token. Recognising the topic from the
other tokens takes the masked-token loss from log(vocab) to about log(8)
within the first hundred steps; copying the pair neighbour through attention
takes it further down, and the accuracy up. Exactly `--masked` positions per
sequence are masked, so the loss is a mean over examples and micro-batching
computes the same update as the whole batch.

The embedding's gradient stays sparse (indexed slices): it is accumulated over
the micro-batches and gathered over the pipelines as rows, not densified.

    python examples/bert_pipeline.py [--steps 300] [--batch 8] [--micro-batches 4]
        [--devices 2] [--strategy PreferBackward|PreferForward] [--layers 4]
"""
from __future__ import annotations

import argparse
import math

from epl.observability.logs import quiet_tensorflow_startup


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8,
                        help="one micro-batch (a step trains on pipelines x micro-batches x batch "
                             "examples)")
    parser.add_argument("--micro-batches", type=int, default=4, help="pipeline.num_micro_batch")
    parser.add_argument("--strategy", default="PreferBackward",
                        choices=["PreferBackward", "PreferForward"], help="pipeline.strategy")
    parser.add_argument("--devices", type=int, default=2,
                        help="virtual CPU devices (CPU only); 4 = 2 pipelines of 2 stages; 0 = "
                             "cluster.virtual_devices (e.g. epl-launch --virtual-devices)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--masked", type=int, default=2, help="masked positions per sequence")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--logdir", help="TensorBoard directory (graph, samples/sec, loss)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()   # --help and bad options answer here, before TensorFlow is imported

with quiet_tensorflow_startup():
    import numpy as np
    import tensorflow as tf

import epl  # noqa: E402
from epl.observability.progress import ProgressHook  # noqa: E402

MASK_ID = 0
GROUP = 8   # tokens of one sequence come from one group of GROUP consecutive ids


def synthetic_dataset(batch: int, seq_len: int, vocab: int, masked: int,
                      seed: int = 0) -> tf.data.Dataset:
    """Batches of (tokens with [MASK]s, masked positions, original tokens there)."""
    rng = np.random.RandomState(seed)
    count = 4096
    groups = (vocab - 1) // GROUP
    topic = rng.randint(0, groups, size=(count, 1))
    pairs = 1 + topic * GROUP + rng.randint(0, GROUP, size=(count, seq_len // 2))
    original = np.repeat(pairs, 2, axis=1).astype(np.int32)
    positions = np.stack([np.sort(rng.choice(seq_len, masked, replace=False))
                          for _ in range(count)]).astype(np.int32)
    targets = np.take_along_axis(original, positions, axis=1)
    tokens = original.copy()
    np.put_along_axis(tokens, positions, MASK_ID, axis=1)
    dataset = tf.data.Dataset.from_tensor_slices((tokens, positions, targets))
    return dataset.shuffle(count, seed=seed).repeat().batch(batch, drop_remainder=True)


def _weight(name: str, shape: list[int], stddev: float = 0.02) -> tf.Variable:
    return tf.compat.v1.get_variable(
        name, shape, initializer=tf.compat.v1.truncated_normal_initializer(stddev=stddev, seed=1))


def layer_norm(x: tf.Tensor, name: str) -> tf.Tensor:
    """Layer normalization over the last axis, with a learned scale and shift."""
    width = x.shape[-1]
    with tf.compat.v1.variable_scope(name):
        gamma = tf.compat.v1.get_variable("gamma", [width], initializer=tf.compat.v1.ones_initializer())
        beta = tf.compat.v1.get_variable("beta", [width], initializer=tf.compat.v1.zeros_initializer())
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta


def dense(x: tf.Tensor, units: int, name: str) -> tf.Tensor:
    """x[..., d] @ W[d, units] + b (einsum keeps the batch dimension symbolic)."""
    with tf.compat.v1.variable_scope(name):
        kernel = _weight("kernel", [x.shape[-1], units])
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.compat.v1.zeros_initializer())
    return tf.einsum("bsd,du->bsu", x, kernel) + bias


def transformer_layer(x: tf.Tensor, heads: int, ff: int, name: str) -> tf.Tensor:
    """Pre-layer-norm encoder layer: multi-head self-attention, then a GELU MLP."""
    seq_len, hidden = x.shape[1], x.shape[2]
    head_dim = hidden // heads
    with tf.compat.v1.variable_scope(name):
        h = layer_norm(x, "ln_attention")

        def split_heads(t):  # [B, T, H*Dh] -> [B, H, T, Dh]
            return tf.transpose(tf.reshape(t, [-1, seq_len, heads, head_dim]), [0, 2, 1, 3])

        q, k, v = (split_heads(dense(h, hidden, n)) for n in ("query", "key", "value"))
        scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(head_dim)
        context = tf.matmul(tf.nn.softmax(scores, axis=-1), v)
        context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [-1, seq_len, hidden])
        x = x + dense(context, hidden, "attention_output")
        h = layer_norm(x, "ln_mlp")
        return x + dense(tf.nn.gelu(dense(h, ff, "intermediate")), hidden, "output")


def embeddings(tokens: tf.Tensor, vocab: int, hidden: int) -> tf.Tensor:
    """Token plus position embeddings, [B, T] -> [B, T, hidden]."""
    seq_len = tokens.shape[1]
    with tf.compat.v1.variable_scope("embeddings"):
        token_table = _weight("tokens", [vocab, hidden])
        position_table = _weight("positions", [seq_len, hidden])
        return tf.gather(token_table, tokens) + position_table


def masked_token_head(x: tf.Tensor, positions: tf.Tensor, targets: tf.Tensor, vocab: int):
    """Loss and accuracy of predicting the original tokens at the masked positions."""
    with tf.compat.v1.variable_scope("mlm_head"):
        picked = tf.gather(x, positions, batch_dims=1)            # [B, K, hidden]
        h = layer_norm(tf.nn.gelu(dense(picked, x.shape[-1], "transform")), "ln")
        logits = dense(h, vocab, "decoder")                      # [B, K, vocab]
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=logits))
    correct = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), targets)
    return loss, tf.reduce_mean(tf.cast(correct, tf.float32))


def build(args) -> tuple:
    """The model of `args` in the default graph: (loss, accuracy, train_op); its two
    stages are the epl.replicate scopes (EPL must be initialized)."""
    tokens, positions, targets = tf.compat.v1.data.make_one_shot_iterator(
        synthetic_dataset(args.batch, args.seq_len, args.vocab, args.masked)).get_next()
    split = args.layers // 2
    with epl.replicate(device_count=1, name="stage_0"):
        x = embeddings(tokens, args.vocab, args.hidden)
        for i in range(split):
            x = transformer_layer(x, args.heads, 4 * args.hidden, f"layer_{i}")
    with epl.replicate(device_count=1, name="stage_1"):
        for i in range(split, args.layers):
            x = transformer_layer(x, args.heads, 4 * args.hidden, f"layer_{i}")
        loss, accuracy = masked_token_head(x, positions, targets, args.vocab)
    epl.add_to_collection(accuracy, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.AdamOptimizer(args.learning_rate).minimize(
        loss, global_step=global_step)
    return loss, accuracy, train_op


def main(argv=None) -> dict:
    """Train; print progress; return the last step's loss and accuracy."""
    args = parse_args(argv)
    config = {"pipeline.num_micro_batch": args.micro_batches,
              "pipeline.strategy": args.strategy, "debug.log_level": "INFO"}
    if args.devices:
        config["cluster.virtual_devices"] = args.devices
    epl.init(epl.Config(config))
    cluster = epl.Env.get().cluster
    args.devices = cluster.gpu_num_per_worker   # this worker's devices
    rank0 = cluster.worker_index == 0
    if rank0:
        print(f"bert_pipeline: {args.steps} steps; building the graph", flush=True)
    with tf.Graph().as_default():
        loss, accuracy, train_op = build(args)
        progress = ProgressHook(batch_size=args.batch,
                                tensors={"loss": loss, "masked-token accuracy": accuracy},
                                every_n_steps=args.log_every, last_step=args.steps,
                                output_dir=args.logdir)
        if rank0:
            print(f"BERT-style encoder: {args.layers} layers, hidden {args.hidden}, vocab "
                  f"{args.vocab}; 2 stages x {args.micro_batches} micro-batches "
                  f"({args.strategy}) on {args.devices} device(s); micro-batch {args.batch}",
                  flush=True)
        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=args.steps), progress]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run(train_op)
    return {"step": progress.step, "loss": float(progress.values["loss"]),
            "accuracy": float(progress.values["masked-token accuracy"])}


if __name__ == "__main__":
    main()
