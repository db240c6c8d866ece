"""`python -m eagle3.bench`."""

from eagle3.bench.app import main

main()
