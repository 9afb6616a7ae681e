"""Parts of `bench_engine.py`, one concern each.

- `machine`: the machine's description, its load after each phase, its memory bandwidth;
- `workload`: the bundled texts, the requests cut from them, greedy sampling, `ThroughputResult`;
- one module per measurement: `hf_baseline` (HF transformers static batching), `throughput`
  (the engine, continuous batching, KV utilisation), `batch1` (batch-1 decode vs the roofline),
  `accuracy` (greedy agreement and perplexity against the unquantized engine);
- `report` (the JSON, raw data and printed summary) and `plot` (the PNG).
"""
