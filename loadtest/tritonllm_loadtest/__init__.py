"""Locust load tests for LLMs served by Triton Inference Server."""
