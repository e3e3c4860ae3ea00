"""The benchmarks behind `specvoice bench KIND`: each prints its figures and writes JSON.

Each module has HELP, DESCRIPTION, add_arguments(parser) and run(args); the registry is
demo/commands/bench.py. Benchmarks are never tests: speed claims come from here.
"""


def report_header(benchmark: str, llm) -> dict:
    """The fields every model benchmark's JSON opens with: what ran, where, on which models
    (`llm`: the config's [llm] section)."""
    import platform
    import sys

    import torch

    return {
        "benchmark": f"specvoice bench {benchmark}",
        "command": "specvoice " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch_threads": torch.get_num_threads(), "device": llm.device},
        "models": {"target": llm.target, "drafter": llm.drafter, "dtype": llm.dtype},
    }
