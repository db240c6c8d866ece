"""`python -m eagle3.study`."""

from eagle3.study.app import main

main()
