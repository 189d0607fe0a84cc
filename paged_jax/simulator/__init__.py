"""A simulated accelerator that *is* the engine: the same scheduler, KV
manager, page state and prefix cache, with only the model call and the
clock replaced (:mod:`paged_jax.simulator.engine`), and the step-time
models that replace them (:mod:`paged_jax.simulator.step_time`) over
device and model shapes (:mod:`paged_jax.simulator.hardware`)."""
