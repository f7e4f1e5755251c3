"""A CPU recipe's kernel term (`kernel_workspace(..., cuda=False)`) runs the layer the PyTorch path
runs: the same DSA ops the traced CPU step dispatches. Before, its frozen warm-up layer called the
dense KL's Triton Function whatever the path (the CUDA path's `dense_kl_*` launchers, with a
"fp32 inputs on the Triton path" warning in every `dsa-train plan` of a CPU recipe)."""

import pytest


@pytest.mark.parametrize("layout", [["parallel.data_parallel=-1"], ["parallel.context_parallel=2"]])
def test_cpu_kernel_term_dispatches_what_the_cpu_step_dispatches(layout):
    import torch
    from omegaconf import OmegaConf

    from dsa_train.config import compose_recipe, resolve_sizes
    from dsa_train.plan import trace as T
    from dsa_train.plan.estimate import model_config_of
    from dsa_train.plan.kernel_workspace import CPU_PATH_OP, kernel_workspace
    from dsa_train.stage import Stage

    cfg = OmegaConf.to_object(compose_recipe("demo", ["data.seq_len=64", "data.micro_batch_size=1", *layout]))
    c, _ = model_config_of(cfg)
    sizes = resolve_sizes(cfg.parallel, 2)
    for name in ("warmup", "sparse"):
        t = T.trace_step(cfg, c, world=2, stage_name=name, kernels="cpu")
        ws = kernel_workspace(c, Stage.of(name, cfg.stages[name]), sizes, cfg.data.seq_len, cfg.data.micro_batch_size,
                              getattr(torch, cfg.model.dtype.value), cuda=False)
        assert set(ws["ops"]) - {CPU_PATH_OP} == set(t["kernel_ops"]), (name, layout, ws["ops"], t["kernel_ops"])
