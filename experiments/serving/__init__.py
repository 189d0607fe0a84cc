"""Serving runs and benchmarks: the demo (``serve_sharegpt``), the paper's
Figures 12-17 (``serving_figures``, ``serving_fig14``, ``serving_ttft``), the
online and HTTP benchmarks, data-parallel scaling and the transformers
baseline."""
