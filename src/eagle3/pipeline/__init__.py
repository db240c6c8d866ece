"""`python -m eagle3.pipeline`: the stages in order, planned before anything runs.

May import: every stage package."""
