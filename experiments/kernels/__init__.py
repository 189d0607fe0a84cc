"""Kernels: the benchmark (``kernel_bench``), the device summary, and every
kernel compiled for TPU and GPU with no device (``compile_kernels``)."""
