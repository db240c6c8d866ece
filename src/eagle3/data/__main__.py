"""`python -m eagle3.data`."""

from eagle3.data.app import main

main()
