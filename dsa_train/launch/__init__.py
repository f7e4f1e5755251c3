"""Starting a recipe on several processes: `launcher` (`dsa-train launch torchrun|slurm`: the
torchrun command or the sbatch script, restarts, rendezvous) and `rank` (`python -m
dsa_train.launch.rank`: what torchrun and Slurm start on every rank)."""
