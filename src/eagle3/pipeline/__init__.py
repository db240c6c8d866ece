"""`python -m eagle3.pipeline`: the stages in order, planned before anything runs; the train stage's
memory per GPU (`python -m eagle3.pipeline.memory`).

May import: core, engine, data, extract, train, export, serve, bench (every stage package)."""
