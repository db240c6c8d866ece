"""`python -m eagle3.export`."""

from eagle3.export.app import main

main()
