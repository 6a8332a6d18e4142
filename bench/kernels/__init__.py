"""Kernel benchmarks: one op at model shapes (GB/s, fraction of measured bandwidth, width ratios)."""
