"""The lifecycle's stages as the flows in `flows/` call them: distillation into a gated dataset, value pretraining,
checkpoint export, evaluation of checkpoints, MLflow stage runs and the model registry, run comparison.

Each stage reads and writes the run home and publishes to the artifact store, and is skipped when its output for
the same inputs (its recipe) is already complete there: a re-run flow resumes instead of redoing work.
"""
