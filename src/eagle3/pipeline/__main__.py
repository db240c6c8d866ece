"""`python -m eagle3.pipeline`."""

from eagle3.pipeline.app import main

main()
