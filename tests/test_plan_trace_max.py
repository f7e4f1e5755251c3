"""`MemoryTrace.category_max`: each category's own maximum over the step, replayed from the trace's
allocation log with each storage's last category (the plan's terms are per-category maxima; the
total's peak can fall where a category is below its maximum)."""

import torch


def test_category_max_counts_each_storage_in_its_last_category():
    from dsa_train.plan.trace import MemoryTrace

    trace = MemoryTrace()
    a = torch.zeros(8, dtype=torch.float32)  # 32 B of activations
    trace.add(a, "activations")
    g = torch.zeros(16, dtype=torch.float32)  # made as an activation, retagged: a gradient all its life
    trace.add(g, "activations")
    trace.retag(g, "gradients")
    del a  # activations back to 0
    b = torch.zeros(4, dtype=torch.float32)
    trace.add(b, "activations")
    trace._bump(40, "activations")  # a transient on top of b: 16 + 40
    mx = trace.category_max()
    assert mx["activations"] == 56 and mx["gradients"] == 64, mx
    # counting from a later event on: what was live then, and what came after
    start = len(trace.events)
    d = torch.zeros(2, dtype=torch.float32)
    trace.add(d, "activations")
    assert trace.category_max(start)["activations"] == 24
    assert trace.category_max(start)["gradients"] == 64


def _in_package(package: str, file: str) -> str:
    """`file`'s path inside the imported `package`'s directory (the file need not exist)."""
    import importlib
    import os

    return os.path.join(os.path.dirname(os.path.abspath(importlib.import_module(package).__file__)), file)


def _function_in(path: str, src: str, name: str, **glob):
    """A function whose frames carry the source file name `path` (as the trace sees the stack)."""
    scope = dict(glob)
    exec(compile(src, path, "exec"), scope)
    return scope[name]


def test_an_allocation_is_categorized_by_the_nearest_project_frame():
    """What the model's code allocates is activations even beneath a kernel's frame (an activation
    checkpoint's recompute runs inside the kernel's backward when it unpacks its saved tensors:
    the 671B warm-up's recomputed layer was counted as 2.67 GiB of DSA buffers that way); what the
    kernels' own code allocates is DSA buffers."""
    from dsa_train.plan.trace import MemoryTrace

    model_code = _function_in(_in_package("dsa_train", "model/layer.py"), "def layer():\n    return torch.empty(1000)\n",
                              "layer", torch=torch)
    kernel_code = _function_in(
        _in_package("dsa_kernels", "ops/kl/function.py"),
        "def backward(recompute):\n    mine = torch.empty(10)\n    return mine, recompute()\n", "backward", torch=torch)
    trace = MemoryTrace()
    with trace:
        mine, recomputed = kernel_code(model_code)
    categories = {n: c for n, c, *_ in trace.live.values()}
    assert categories[4 * 10] == "dsa_buffers" and categories[4 * 1000] == "activations", categories


def test_a_path_that_merely_names_the_project_is_not_the_projects_code():
    """A checkout called dsa_train/ (the project's name) holds its .venv, so torch's own Python files
    have "dsa_train" in their path: a torch frame between the allocation and the kernel's frame
    (here a function in such a torch file, as `torch.nn.functional`'s are) is not the model's code.
    Matched by substring, everything beneath torch's Python functions was activations there."""
    from dsa_train.plan.trace import MemoryTrace

    torch_code = _function_in("/home/u/dsa_train/.venv/lib/python3.12/site-packages/torch/nn/functional.py",
                              "def op(n):\n    return torch.empty(n)\n", "op", torch=torch)
    kernel_code = _function_in(_in_package("dsa_kernels", "ops/kl/function.py"),
                               "def forward(op):\n    return op(10)\n", "forward")
    model_code = _function_in(_in_package("dsa_train", "model/layer.py"),
                              "def layer(op):\n    return op(1000)\n", "layer")
    trace = MemoryTrace()
    with trace:
        kept = kernel_code(torch_code), model_code(torch_code)
    categories = {n: c for n, c, *_ in trace.live.values()}
    assert categories == {4 * 10: "dsa_buffers", 4 * 1000: "activations"}, categories
    assert len(kept) == 2


def test_logsumexp_counts_its_own_temporary():
    """`torch.logsumexp` allocates a copy of its input inside itself (`(x - amax).exp_()`), which
    its outputs do not show: the trace adds it as a transient of the op's category (the loss's
    forward holds it beside its fp32 row chunk: the demo's activations' maximum). The size is the
    installed torch's, measured by its profiler on real tensors."""
    from torch.profiler import ProfilerActivity, profile

    from dsa_train.plan.trace import MemoryTrace, _logsumexp_temporary

    x = torch.randn(64, 512)  # 128 KiB, made before the trace: not counted
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.logsumexp(x, dim=-1)
    largest = max(e.self_cpu_memory_usage for e in prof.key_averages())
    assert largest == _logsumexp_temporary(x) == x.numel() * 4, (largest, _logsumexp_temporary(x))
    trace = MemoryTrace()
    with trace:
        y = torch.logsumexp(x, dim=-1)
    assert trace.category_max()["activations"] == y.untyped_storage().nbytes() + x.numel() * 4
