"""Clients for LLMs served by Triton Inference Server."""
