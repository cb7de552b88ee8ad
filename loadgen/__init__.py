"""Load generator and serving benchmark for duet.v1.DecodeNode/Generate and OpenAI-compatible HTTP
servers (like `vllm bench serve`).

In-process use::

    result = run_benchmark(BenchmarkConfig(target="127.0.0.1:50051", num_requests=32, request_rate=4))
    print(format_table(result))
"""
from loadgen.config import BenchmarkConfig
from loadgen.report import format_table, write_json
from loadgen.runner import BenchmarkResult, run_benchmark

__all__ = ["BenchmarkConfig", "BenchmarkResult", "format_table", "run_benchmark", "write_json"]
