"""Benchmark of the token mixers across resolutions: ``python -m timm_odevit_tools.benchmark``."""
