"""Session and optimizer integration: the hooks that make a plain training script
parallel (the layer between EPL's API and its driver, epl/parallel.py).

- `epl.hooks.optimizer`: gradient time (the optimizer's compute_gradients and
  apply_gradients, the user's tf.gradients): records the training step and runs
  the gradient-time pipeline (split) before autodiff.
- `epl.hooks.session`: parallelize time (the first session on an annotated
  graph, MonitoredTrainingSession's scaffold) and run time (fetches of merged
  tensors, feeds, variable sync, bounded multi-worker runs).
- `epl.hooks.function`: tf.function training steps in eager TensorFlow 2 (the
  tape inside a trace, the rewrite of the traced graph); `epl.hooks.keras`: Keras 3
  layers (their scopes) and optimizers (their updates); `epl.hooks.legacy_keras`:
  tf-keras in graph mode (its training step, its early session,
  epl.hooks.late_rewrite).
- Savers: checkpoints of split variables under their single-device names
  (epl.checkpoint.sharded_variable).
- `epl.hooks.record`: each graph's `GraphRecord` (what construction and gradient
  time saw), found there and handed on explicitly to everything below.

`install()` (called by `epl.init`) wraps TensorFlow's methods, once.
"""


def install() -> None:
    """Install every hook (idempotent). The modules are imported here, not at the
    package's import, so that the scopes (epl/strategies.py) can use
    epl.hooks.record without importing the hooks that use the scopes' layer."""
    from epl.checkpoint import sharded_variable
    from epl.hooks import eager_scopes, function, keras, legacy_keras, optimizer, session
    optimizer.install()
    session.install()
    sharded_variable.install_saver_support()
    function.install()
    keras.install()
    legacy_keras.install()
    eager_scopes.on_eager_enter(keras.install)
