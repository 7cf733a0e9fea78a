"""EXL3 mixture-of-experts forwards for verify rounds, independent of any engine: they take an MoE layer's pointer
tables and, for the union path, a multi-matrix EXL3 GEMM (exllamav3's on a GPU, a torch reference in tests)."""
