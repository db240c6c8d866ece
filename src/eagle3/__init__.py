"""eagle3: train EAGLE-3 drafters for a target LLM and find the fastest way to serve them."""

__version__ = "0.1.0"
