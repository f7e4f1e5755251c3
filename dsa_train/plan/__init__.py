"""`dsa-train plan`: what a recipe needs per GPU before any GPU is used. `estimate` (the command:
memory per rank and step time, FLOPs counted on the path that runs), `comm` (the collectives' bytes
and times), `trace` / `trace_comm` (one rank's step traced under FakeTensorMode and fake process
groups: saved tensors, recomputes, peak memory, collectives)."""
