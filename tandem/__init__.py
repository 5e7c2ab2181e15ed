"""Tandem's command line, the all-in-one launcher and the built-in toy model."""
