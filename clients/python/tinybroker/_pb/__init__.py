"""Code generated from proto/tinybroker/v1 by scripts/generate.py; do not edit."""
