"""EXL3 mixture-of-experts forwards for verify rounds, independent of any engine: they take an MoE layer as plain
tensors and formats (weights.py: `Exl3Weight`, `MoeLayer`) and, for the union path, a multi-matrix EXL3 GEMM
(exllamav3's on a GPU, a torch reference in tests). Nothing here reads an engine's objects."""
