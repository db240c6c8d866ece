"""`python -m eagle3.extract`."""

from eagle3.extract.app import main

main()
