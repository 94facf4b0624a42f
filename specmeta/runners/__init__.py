"""CUDA-graph runners and padding policies (design §4)."""

from .graph_runner import GraphRunner, RunResult, StaticInput, collector_off
from .ragged_runner import RaggedGraphRunner

__all__ = ["GraphRunner", "RaggedGraphRunner", "RunResult", "StaticInput", "collector_off"]
