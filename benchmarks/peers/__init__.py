"""Helpers of `bench_peers.py`: peer installs, managed servers, token-id workloads and the report."""
