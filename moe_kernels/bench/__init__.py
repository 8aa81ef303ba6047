"""The measurement commands, one CLI: ``python -m moe_kernels.bench <command>``.

Each command times kernels on a CUDA GPU against floors built from ceilings measured in the same
run, and with ``--record`` writes ``results/<device>/<name>.json`` with provenance. Benchmarks are
not tests: the tests check correctness, these report speed.
"""
