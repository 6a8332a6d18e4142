"""Runtime-step benchmarks: one replay step (draft/verify over AR step cost, CUDA-graph replay over eager)."""
