"""The split pass's parts (epl/passes/split/split.py is the pass and runs them):
region (which ops and variables each split TaskGraph rewrites), layouts (the
layouts and the SplitRecord), rules (the rule registry), rewriter (the walk over
one region, its fallbacks and warnings), and one module per family of rules:
matmul (MatMul, the expert BatchMatMul), einsum (Einsum), elementwise (unary and
binary elementwise ops, BiasAdd, Reshape, L2Loss), embedding (GatherV2,
ResourceGather) and softmax (Softmax, LogSoftmax, the softmax cross-entropies).
boundary: where the replicate pass meets the split ops."""
