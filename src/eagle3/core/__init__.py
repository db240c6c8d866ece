"""The parts every stage shares: speculation shapes, targets, the drafter and its on-disk forms,
stage outputs and their hashes, MLflow tracking, processes and errors.

May import: no other eagle3 package."""
