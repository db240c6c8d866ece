"""`python -m eagle3.export`: the trained drafter as the folders SGLang, vLLM and speculators load,
key- and shape-checked; the shipped drafter; an unfinished training's newest checkpoint
(`python -m eagle3.export.checkpoint`).

May import: core."""
