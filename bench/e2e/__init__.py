"""End-to-end benchmarks: whole generations (speedup over AR on the same runtime, committed tokens/iteration)."""
