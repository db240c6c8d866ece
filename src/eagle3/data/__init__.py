"""`python -m eagle3.data`: prompts -> conversations (optionally answered by the target) -> token ids
+ loss masks -> the draft vocabulary; also the bench prompt suites.

May import: core, serve (an engine answers the prompts)."""
