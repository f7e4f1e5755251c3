"""DeepSpeed's gradient bucket: the engine configures its reduce / all-gather buckets with it, and
the planner (`plan/estimate.py`) and the traced step (`plan/trace.py`) count one such bucket of
fp32 gradients."""

REDUCE_BUCKET = int(5e7)  # elements
