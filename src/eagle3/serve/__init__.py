"""`python -m eagle3.serve`: an engine process (local | vllm | sglang) started, health-checked and
stopped; the embedded engine's HTTP front and its in-process use; engine counters.

May import: core, engine, export."""
