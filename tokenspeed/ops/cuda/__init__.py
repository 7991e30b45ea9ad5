"""CUDA paths that are not our own Triton kernels: fla-core's chunked KDA and PyTorch's fused SDPA.

Imported on first use by `tokenspeed.ops` for CUDA tensors only (same dispatch rule as `tokenspeed.ops.triton`),
except `sdpa`, which the MLA layer imports with the model (its `padded_rows`), so that the cuDNN plan setting it
makes at import precedes any attention call of the process.
"""
