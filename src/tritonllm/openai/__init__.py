"""OpenAI-compatible front door for the Triton models: `tritonllm openai` (see `app.py`)."""
