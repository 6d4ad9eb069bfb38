"""Forward Triton kernels and their launchers, one module per op family."""
