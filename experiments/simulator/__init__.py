"""Scripts of the simulated accelerator: profile the real step, validate the simulation, and the
serving figures at the paper's scale (:mod:`paged_jax.simulator`)."""
