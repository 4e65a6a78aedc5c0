"""The fused MSDA operator's kernels (native CPU and CUDA libraries, numba) and their registration with
onnxruntime: torch-free, imported by both the export side and the runtime."""
