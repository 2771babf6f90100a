"""Reproducible training of a small reference target/draft model pair on a corpus every Python 3.11 has."""
