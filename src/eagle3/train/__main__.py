"""`python -m eagle3.train`."""

from eagle3.train.app import main

main()
