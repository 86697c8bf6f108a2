"""Prompt sources and tokenizers."""
