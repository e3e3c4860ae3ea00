"""The benchmarks behind `specvoice bench KIND`: each prints its figures and writes JSON.

Each module has HELP, DESCRIPTION, add_arguments(parser) and run(args); the registry is
demo/commands/bench.py. Benchmarks are never tests: speed claims come from here.
"""
