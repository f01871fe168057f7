"""How far EPL's training and two reorderings of single-device training move the
variables, on one oracle case: what the oracle's noise floor (tests/conftest.py,
`noise_floor`) is made of, measured on this machine's CPU.

    TF_USE_LEGACY_KERAS=1 .venv/bin/python scripts/oracle_reorderings.py
    ... scripts/oracle_reorderings.py --model mlp --optimizer sgd --weights 3 1

The case is tests/passes/test_replicate_oracle.py's uneven shares: the model
trained 5 steps on len(weights) virtual devices with io.batch_mode 'global' and
the given replica weights, with the unit functions' calls (the default) and with
the copies (pipeline.unit_functions False). Printed: the largest difference from
single-device training of each, and of the two reorderings the floor takes (the
loss as the mean of the batch's two halves' losses; Grappler's arithmetic
optimizer off). The oracle's atol is max(1e-6, 10 x the larger floor).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--weights", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
    import numpy as np

    import conftest   # the oracle's models and training loop
    import epl
    from epl import env

    kwargs = dict(model=args.model, optimizer=args.optimizer, inputs="placeholder")
    env.reset()
    reference = conftest.train(args.steps, units=1, **kwargs)

    def difference(result) -> float:
        return max(float(np.max(np.abs(result.variables[name] - value)))
                   for name, value in reference.variables.items())

    found = {}
    env.reset()
    found["floor: loss as the mean of two halves"] = difference(
        conftest.train(args.steps, units=1, chunks=2, **kwargs))
    env.reset()
    found["floor: arithmetic optimizer off"] = difference(
        conftest.train(args.steps, units=1, session_config=conftest.arithmetic_optimizer_off(),
                       **kwargs))
    for calls in (True, False):
        env.reset()
        epl.init(epl.Config({"cluster.virtual_devices": len(args.weights),
                             "io.batch_mode": "global", "pipeline.unit_functions": calls}))
        found["EPL, unit functions' calls" if calls else "EPL, copies"] = difference(
            conftest.train(args.steps, replica_weights=args.weights, **kwargs))
    env.reset()
    print(f"{args.model}, {args.optimizer}, weights {args.weights}, {args.steps} steps: the "
          "largest difference of any variable from single-device training")
    for label, value in found.items():
        print(f"  {label}: {value:.2e}")
    return found


if __name__ == "__main__":
    main()
