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
