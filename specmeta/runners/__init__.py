"""CUDA-graph runners and padding policies."""
