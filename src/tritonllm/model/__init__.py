"""Llama-family model code for the project's engine: flat modules, paged attention, quantized linears."""
