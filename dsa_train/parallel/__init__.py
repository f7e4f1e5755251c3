"""Parallelism of one run: the layout (`Layout` for one process, `DistributedLayout` for N ranks;
`init_layout`), megatron-core's groups (`groups`), `parallelize_model` (TP, EP, CP, recompute;
`model`, `tensor`, `expert`, `context`), the collectives (`comm`, `buckets`), the gradient
reduction (`reduction`) and DeepSpeed's adapter (`deepspeed_compat`). It builds no engine and runs
no step: the trainer does (dsa_train.trainer)."""
