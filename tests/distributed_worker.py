"""One process of the two-process test in tests/test_sharding.py (not a test
module: pytest does not collect it).

Run as ``python tests/distributed_worker.py OUT_JSON`` with
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES=2`` and ``JAX_PROCESS_ID``
set and 4 faked CPU devices per process. Both processes form one (2, 4) mesh
over the 8 devices (data shard 0 on process 0's devices, the model axis of
each shard within a process) and one (1, 8) mesh whose model axis spans both
processes (its all-reduces cross processes), prefill and decode a tiny
model through :class:`models.sharded.ShardedLlama`, and gather the logits.
Then they serve 12 requests with one engine per data shard of the (2, 4)
mesh, each process its own shard's, and gather the outputs. Process 0
compares everything with the same model on one device and writes the
result to OUT_JSON.
"""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repository (paged_jax, models) and tests/

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from paged_jax.distributed.sharding import init_distributed, make_mesh  # noqa: E402


def main(out_path: str) -> None:
    index, count = init_distributed()
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from sharded_cases import TINY_GQA, decode_sharded, decode_unsharded, make_prompts

    from models.llama import Llama

    model = Llama(TINY_GQA, rngs=nnx.Rngs(0))
    prompts = make_prompts(8, TINY_GQA.vocab_size, seed=0)
    result = {"process_index": index, "process_count": count, "devices": jax.device_count(),
              "local_devices": jax.local_device_count()}
    want_tokens, want_logits = decode_unsharded(model, prompts, steps=3, device=jax.local_devices()[0])
    for data, m in ((2, 4), (1, 8)):
        tokens, logits = decode_sharded(model, make_mesh(data, m), prompts, steps=3,
                                        gather=lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)))
        result[f"{data}x{m}"] = {"tokens_equal": bool(np.array_equal(tokens, want_tokens)),
                                 "max_logit_diff": float(np.max(np.abs(logits - want_logits)))}
    # The engine: one per data shard, each process serving its own shard's
    # requests (placed by tokens), every output gathered to every process.
    from models.ragged import RaggedModel
    from models.sharded import make_data_parallel_engine
    from paged_jax.distributed.data_parallel import gather_outputs
    from paged_jax.engine.core import Engine, EngineConfig, Request

    config = EngineConfig(max_seqs=4, max_seq_len=32, max_num_batched_tokens=32)
    requests = [Request(request_id=i, prompt_ids=p, max_new_tokens=1 + i % 6)
                for i, p in enumerate(make_prompts(12, TINY_GQA.vocab_size, seed=1))]
    one = Engine(RaggedModel(model), TINY_GQA.make_kv_pool(20, 4), config)
    want = {o.request_id: o.output_ids for o in one.run(requests)}
    dp = make_data_parallel_engine(model, make_mesh(2, 4), config, pages_per_shard=20, page_size=4)
    local = dp.run(requests)
    got = gather_outputs(local, [r.request_id for r in requests], 6)
    result["engine"] = {"local_engines": len(dp.local_engines), "local_outputs": len(local),
                        "same_outputs": sum(got.get(i) == want[i] for i in want), "requests": len(requests)}
    if index == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main(sys.argv[1])
