"""`python -m eagle3.study`: how much data buys how much acceptance, and its report.

May import: core, engine, data, train."""
