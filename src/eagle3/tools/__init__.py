"""Tools around the stages: the offline bundle (`python -m eagle3.tools.bundle`), measured results
as MLflow runs (`eagle3.tools.results`), the MLflow UI (`eagle3.tools.ui`), `eagle3.tools.info`.

May import: core, export, serve."""
