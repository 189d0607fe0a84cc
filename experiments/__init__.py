"""Experiment scripts that reproduce the paper's tables and figures, by topic.

- :mod:`experiments.memory`: the memory study (KV sizes, waste, capacity,
  sharing, the hybrid models' capacity, the draggable layout diagram);
- :mod:`experiments.serving`: serving runs and benchmarks (the demo, the
  paper's Figures 12-17, the online and HTTP benchmarks, data-parallel
  scaling, the transformers baseline);
- :mod:`experiments.kernels`: kernel benchmarks and ahead-of-time compiles for
  TPU and GPU;
- :mod:`experiments.train_tiny`: training a tiny decoder and serving it;
- :mod:`experiments.lib`: what the scripts share (flags, tables, provenance,
  ShareGPT, workloads, the online driver). Scripts import it and never one
  another (``tests/test_layout.py``).

Run a script as ``python -m experiments.<topic>.<script> --help``.
"""
