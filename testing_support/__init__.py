"""Test fixtures: tiny random models (tiny_models) and the GGUF files written from them
(tiny_gguf), for the test suite and the benchmarks that make their own model.

Not part of the product: ``pip install .`` leaves this package out (pyproject's package list),
so it is imported from a checkout only (the tests run there; benchmarks/fixtures.py finds it).
"""
