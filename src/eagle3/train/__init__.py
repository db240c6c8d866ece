"""`python -m eagle3.train`: the drafter trained with the TTT unroll under Lightning (one process,
DDP, FSDP, SLURM).

May import: core, engine, data, extract."""
