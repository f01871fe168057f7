"""optimizer.num_apply_group: updates ordered in groups, same numbers."""
import tensorflow as tf

import epl
from epl.passes.apply_groups import update_groups


def test_apply_groups_order_updates_and_keep_numbers(models, epl_env):
    reference = models.single_device(model="mlp", optimizer="adam")
    epl_env({"cluster.virtual_devices": 2, "optimizer.num_apply_group": 3})
    with tf.Graph().as_default() as graph:
        models.build("mlp", "adam")
        result = epl.parallelize(graph)
    groups = update_groups(graph, 3, result.view.train_ops)
    assert sorted(groups) == [0, 1]
    for replica_groups in groups.values():
        assert len(replica_groups) == 3
        # 6 weights, Adam's two beta powers and the global step
        assert sum(len(g) for g in replica_groups) == 9
        for earlier, later in zip(replica_groups, replica_groups[1:]):
            for op in later:
                assert set(earlier) <= set(op.control_inputs)
    epl_env({"cluster.virtual_devices": 2, "optimizer.num_apply_group": 3})
    models.assert_same_training(models.train(model="mlp", optimizer="adam"), reference)
