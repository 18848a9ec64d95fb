"""Flower ClientApps of fl-rescaled."""
