"""The GPU path: berth's fused forward in CUDA graphs, its kernels and products."""
