"""DeepSpeed's gradient bucket: the engine configures its reduce / all-gather buckets with it, and
the planner (`parallel/plan.py`) and the traced step (`parallel/trace.py`) count one such bucket of
fp32 gradients."""

REDUCE_BUCKET = int(5e7)  # elements
