"""Runs one training job for the reliability tests and writes its per-step metrics.

    python tests/reliability_driver.py OUT.json RECIPE [override ...]

Like `dsa-train --config-name RECIPE override ...` without Hydra's app wrapper, so the test can
read `result.history` (floats round-trip exactly through JSON). Exits with the trainer's codes:
0 done, 75 preempted (history so far still written), 1 on an error.
"""

import json
import sys


def main(argv: list[str]) -> int:
    out, recipe, *overrides = argv
    from dsa_train.config import load_recipe
    from dsa_train.trainer.trainer import train
    from dsa_train.signals import Preempted

    def dump(result, code):
        with open(out, "w") as f:
            json.dump({"history": result.history, "exit": code, "wandb_run_id": result.wandb_run_id}, f)

    try:
        result = train(load_recipe(recipe, overrides))
    except Preempted as err:
        dump(err.result, err.code)
        raise
    dump(result, 0)
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
