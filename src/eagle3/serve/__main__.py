"""`python -m eagle3.serve`."""

from eagle3.serve.app import main

main()
