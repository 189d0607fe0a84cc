"""What the experiment scripts share: flags (:mod:`~experiments.lib.cli`), tables
and provenance, ShareGPT requests, workloads and policies, the online driver
and its HTTP backend, the serving harness, the ahead-of-time compilers'
drivers. Modules here never import a script."""
