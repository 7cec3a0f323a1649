"""Semantic-aware predictors (SAPs): profile, train, export, run. Installed as halo.predictors."""
