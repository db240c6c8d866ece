"""eagle3: train EAGLE-3 drafters for a target LLM and find the fastest way to serve them.

Role packages, each importing only those below it: core (shared parts) < engine (the embedded
decoder) < export < serve < data < extract < train < bench, study < pipeline; tools sit beside
them. The stages run as `python -m eagle3.<stage>`; the tools as `python -m eagle3.tools.<tool>`.
"""

__version__ = "0.1.0"
