"""`python -m eagle3.export`: the trained drafter as the folders SGLang, vLLM and speculators load,
key- and shape-checked; the shipped drafter.

May import: core."""
