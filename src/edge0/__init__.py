"""edge0: serve Mixture-of-Experts language models with their experts on SSD."""

__version__ = "0.1.0"
