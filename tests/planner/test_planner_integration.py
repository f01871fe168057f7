"""The planner's shares reach the replicate pass: mixed virtual devices, same numbers."""
import numpy as np

import epl


import pytest


@pytest.mark.parametrize("mode,inputs", [("global", "placeholder")])
def test_mixed_profiles_give_uneven_shares_and_same_training(models, epl_env, mode, inputs):
    """Uneven shares need batches of different sizes: io.batch_mode 'global' (the
    script's batch sliced by share)."""
    reference = models.single_device(model="mlp", optimizer="adam", inputs=inputs)
    # CPU:0 stands for a V100, CPU:1 for a far slower device (compute must dominate the
    # tiny test model's fixed costs for balancing to pay off).
    profiles = {"CPU:0": "V100-32GB", "CPU:1": {"base": "V100-32GB", "peak_flops": {"float32": 2e9, "float16": 2e9, "bfloat16": 2e9}}}
    config = {"cluster.virtual_devices": 2, "cluster.device_profiles": profiles,
              "io.batch_mode": mode}
    epl_env(config)
    import tensorflow as tf
    with tf.Graph().as_default() as graph:
        models.build("mlp", "adam", inputs=inputs)
        result = epl.parallelize(graph)
    weights = result.plan.replica_weights
    assert weights[0] > weights[1]
    sizes = result.plan.batch_sizes(models.BATCH)
    assert sum(sizes) == models.BATCH and sizes[0] > sizes[1] >= 1
    epl_env(config)
    models.assert_same_training(models.train(model="mlp", optimizer="adam", inputs=inputs),
                                reference)
    np.testing.assert_allclose(sum(weights), 1.0)
