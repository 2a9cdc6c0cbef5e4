"""Offline export: a model (Hugging Face directory, GGUF file or built-in name) -> N stage shards.

This is the only package that needs torch, optimum-intel and NNCF. Nothing in the runtime
(`server/`, `stage_node/`) imports it.
"""
