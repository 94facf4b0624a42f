"""CUDA-graph runners and padding policies (design §4)."""

from .graph_runner import GraphRunner, RunResult, StageBatch, StaticInput, StaticOutput

__all__ = ["GraphRunner", "RunResult", "StageBatch", "StaticInput", "StaticOutput"]
