"""CUDA-graph runners and padding policies (design §4)."""

from .graph_runner import GraphRunner, RunResult, StaticInput, collector_off

__all__ = ["GraphRunner", "RunResult", "StaticInput", "collector_off"]
