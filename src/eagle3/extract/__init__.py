"""`python -m eagle3.extract`: the target's hidden states as verified safetensors shards, from HF in
process or from a vLLM server.

May import: core, data, serve."""
