"""`python -m eagle3.bench`: speculation shapes deployed and measured, sweeps and their MLflow runs,
concurrency sweeps, verdicts, the cost model and the shape search.

May import: core, engine, data, serve."""
