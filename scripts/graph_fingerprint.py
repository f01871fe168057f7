"""Fingerprint the final parallel graphs of the pass-golden configurations and a BERT-like
model under pipeline + AMP + gradient checkpointing: op names, types, devices, data and
control edges (a refactoring that must leave the rewrite identical prints the same lines).

    cd <a checkout> && PYTHONPATH=$PWD python scripts/graph_fingerprint.py
"""
import hashlib, os, sys
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
root = os.getcwd()
sys.path[:0] = [root, os.path.join(root, "tests"), os.path.join(root, "tests", "passes")]
import tensorflow as tf
import epl
from epl import env
import test_pass_golden as golden
import bert_like

def canon(graph):
    lines = []
    for op in graph.get_operations():
        lines.append("%s|%s|%s|%s|%s" % (op.name, op.type, op.device, ",".join(t.name for t in op.inputs),
                                         ",".join(sorted(c.name for c in op.control_inputs))))
    lines.sort()
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], len(lines)

def run(config, build):
    env.reset(); epl.init(epl.Config(dict(config)))
    with tf.Graph().as_default() as g:
        build()
        epl.parallelize()
        out = canon(g)
    env.reset()
    return out

for name, (config, options) in golden.CASES.items():
    print(name, *run(config, lambda: golden._build(**options)))
examples = bert_like.make_examples(16)
print("bert_pipeline_amp_gc", *run({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
      "amp.level": "O1", "amp.loss_scale": 128.0, "gradient_checkpoint.type": "collection"},
      lambda: bert_like.build_pretraining(4, examples, stages=True, checkpoint_layers=True)))
