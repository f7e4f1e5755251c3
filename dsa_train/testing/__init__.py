"""Checks of the product that run outside the unit tests, each a torchrun entry point:

- `selftest`: distributed training equals one process, on any layout
  (`torchrun --nproc_per_node 2 -m dsa_train.testing.selftest --zero 2`);
- `memcheck`: a distributed CPU run's measured peak memory next to `dsa-train plan`'s estimate
  (`torchrun --nproc_per_node 2 -m dsa_train.testing.memcheck --zero 2 --seq-len 1024`);
- `gradients`: the full gradients an engine holds between backward and step, for the self-test.

Nothing in the training path imports this package.
"""
