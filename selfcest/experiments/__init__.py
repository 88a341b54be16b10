"""Experiments: self-contained pipelines that train, evaluate and report (see each module)."""
