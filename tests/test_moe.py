"""Mixture-of-experts layers (models.layers.moe): the routers of DeepSeek-V3,
DeepSeek-V2 and Qwen3-MoE choose the experts and weights transformers'
do, on random inputs and on crafted ties; the routed experts as grouped
matmuls equal the one-hot dispatch and transformers' experts, and a whole
DeepSeek-V3 MoE block (routed plus shared experts) equals transformers'.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers.moe import (
    RouterConfig,
    route,
    routed_experts,
    routed_experts_dense,
    routed_experts_ragged,
    routed_experts_sharded,
)
from paged_jax.distributed.sharding import make_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _chosen(weights, experts):
    """Per token, {expert: weight}: the order top-k returns them in is not
    part of either router's contract."""
    return [dict(zip(e.tolist(), w.tolist())) for w, e in zip(np.asarray(weights), np.asarray(experts))]


def _assert_same_choice(ours, theirs):
    (w, e), (tw, te) = ours, theirs
    got, want = _chosen(w, e), _chosen(tw, te)
    for token, (g, t) in enumerate(zip(got, want)):
        assert g.keys() == t.keys(), f"token {token}: experts {sorted(g)} vs transformers' {sorted(t)}"
        np.testing.assert_allclose([g[k] for k in sorted(g)], [t[k] for k in sorted(t)], rtol=1e-5, atol=1e-6)


def _v3_router(e=16, k=4, n_group=4, topk_group=2, scale=2.5, seed=0):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=scale)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, 32, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.3)
    ours = RouterConfig(e, k, "sigmoid", n_group, topk_group, norm_topk_prob=True, routed_scaling_factor=scale)
    return router, ours


def _torch_route(router, x):
    with torch.no_grad():
        _, w, e = router(torch.from_numpy(np.asarray(x)))
    return w.numpy(), e.numpy()


def _our_route(router, config, x, bias=True):
    logits = jnp.asarray(x) @ jnp.asarray(router.weight.detach().numpy()).T
    b = jnp.asarray(router.e_score_correction_bias.numpy()) if bias else None
    return route(logits, config, b)


def test_deepseek_v3_router_chooses_as_transformers_does():
    """Sigmoid scores, the correction bias in the choice only, group-limited
    top-k (groups by the sum of their two best), normalized and scaled."""
    router, config = _v3_router()
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    _assert_same_choice(_our_route(router, config, x), _torch_route(router, x))


def test_deepseek_v3_router_on_crafted_ties():
    """Experts whose router rows are equal always tie: experts 0 and 1 (one
    group), and groups 1 and 2 as a whole (2 = 4, 3 = 5). Which of two tied
    experts torch's top-k keeps is unspecified (its selection order), so
    the routers must agree up to swapping tied experts: the same weights on
    the same classes of equal experts. Ours keeps the lower index."""
    router, config = _v3_router(e=8, k=2, n_group=4, topk_group=2, seed=1)
    with torch.no_grad():
        w = router.weight
        w[1], w[4], w[5] = w[0], w[2], w[3]
        router.e_score_correction_bias.zero_()
    same = {0: 0, 1: 0, 2: 2, 4: 2, 3: 3, 5: 3, 6: 6, 7: 7}  # each expert's class of equal ones
    x = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    ours, theirs = _our_route(router, config, x), _torch_route(router, x)
    swapped = 0
    for g, t in zip(_chosen(*ours), _chosen(*theirs)):
        mine, want = sorted((same[e], w) for e, w in g.items()), sorted((same[e], w) for e, w in t.items())
        assert [c for c, _ in mine] == [c for c, _ in want]
        np.testing.assert_allclose([w for _, w in mine], [w for _, w in want], rtol=1e-5)
        swapped += g.keys() != t.keys()
        for e in g:  # a tie resolved to the lower index: a tied twin below it is chosen too
            assert all(f in g for f in same if same[f] == same[e] and f < e)
    assert swapped > 0  # the ties were real: torch kept another twin at least once


@pytest.mark.parametrize("method, n_group, topk_group", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_deepseek_v2_router_chooses_as_transformers_does(method, n_group, topk_group):
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, topk_method=method,
                           n_group=n_group, topk_group=topk_group, routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=torch.Generator().manual_seed(2)))
    x = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    config = RouterConfig(16, 4, "softmax", n_group, topk_group, routed_scaling_factor=1.5)
    _assert_same_choice(_our_route(router, config, x, bias=False), _torch_route(router, x))


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_router_chooses_as_transformers_does(norm):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2,
                                               norm_topk_prob=norm))
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32, generator=torch.Generator().manual_seed(3)))
    x = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32)
    _assert_same_choice(_our_route(router, RouterConfig(8, 2, norm_topk_prob=norm), x, bias=False),
                        _torch_route(router, x))


def _expert_weights(rng, e=8, d=32, i=16):
    return [jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.2) for s in ((e, d, i), (e, d, i), (e, i, d))]


def test_grouped_matmul_equals_one_hot_dispatch():
    rng = np.random.default_rng(4)
    w_gate, w_up, w_down = _expert_weights(rng)
    x = jnp.asarray(rng.standard_normal((40, 32)).astype(np.float32))
    weights, experts = route(x @ jnp.asarray(rng.standard_normal((32, 8)).astype(np.float32)), RouterConfig(8, 3))
    ragged = jax.jit(routed_experts_ragged)(x, experts, weights, w_gate, w_up, w_down)
    dense = jax.jit(routed_experts_dense)(x, experts, weights, w_gate, w_up, w_down)
    np.testing.assert_allclose(ragged, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", [2, 4, 8])
def test_experts_split_over_the_mesh_equal_unsharded(model):
    """Expert parallelism on 8 faked devices: 8 experts over 2, 4 or 8
    devices of the model axis give the unsharded outputs."""
    rng = np.random.default_rng(7)
    w_gate, w_up, w_down = _expert_weights(rng)
    x = jnp.asarray(rng.standard_normal((40, 32)).astype(np.float32))
    weights, experts = route(x @ jnp.asarray(rng.standard_normal((32, 8)).astype(np.float32)), RouterConfig(8, 2))
    mesh = make_mesh(8 // model, model)
    got = routed_experts_sharded(mesh)(x, experts, weights, w_gate, w_up, w_down)
    np.testing.assert_allclose(got, routed_experts_ragged(x, experts, weights, w_gate, w_up, w_down),
                               rtol=1e-5, atol=1e-6)
    explicit = jax.make_mesh((8 // model, model), ("data", "model"))  # explicit axes by default
    np.testing.assert_allclose(routed_experts_sharded(explicit)(x, experts, weights, w_gate, w_up, w_down), got,
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="6 experts do not split over the mesh's 'model' axis"):
        routed_experts_sharded(make_mesh(2, 4))(x, experts, weights, w_gate[:6], w_up[:6], w_down[:6])
    with pytest.raises(ValueError, match="axis='experts' is not an axis of the mesh"):
        routed_experts_sharded(mesh, "experts")


def test_a_deepseek_v3_moe_block_equals_transformers():
    """Routed experts (grouped matmul and one-hot) plus the shared experts,
    against transformers' DeepseekV3MoE with the same random weights."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=2, topk_group=1, n_shared_experts=1, norm_topk_prob=True,
                           routed_scaling_factor=2.5, hidden_act="silu")
    block = DeepseekV3MoE(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        block.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
    x = np.random.default_rng(5).standard_normal((1, 24, 32)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()[0]

    def t(p):
        return jnp.asarray(p.detach().numpy())

    gate_up = t(block.experts.gate_up_proj)  # [E, 2I, D]
    w_gate, w_up = gate_up[:, :16].transpose(0, 2, 1), gate_up[:, 16:].transpose(0, 2, 1)
    w_down = t(block.experts.down_proj).transpose(0, 2, 1)  # [E, D, I] -> [E, I, D]
    config = RouterConfig(8, 2, "sigmoid", 2, 1, norm_topk_prob=True, routed_scaling_factor=2.5)
    h = jnp.asarray(x[0])
    weights, experts = route(h @ t(block.gate.weight).T, config, t(block.gate.e_score_correction_bias))
    s = block.shared_experts
    shared = (jax.nn.silu(h @ t(s.gate_proj.weight).T) * (h @ t(s.up_proj.weight).T)) @ t(s.down_proj.weight).T
    for experts_fn in (routed_experts_ragged, routed_experts_dense):
        got = experts_fn(h, experts, weights, w_gate, w_up, w_down) + shared
        np.testing.assert_allclose(got, want, rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_experts=8, top_k=9), "top_k must be an int in [1, 9)"),
    (dict(num_experts=8, top_k=2, scoring="relu"), "scoring"),
    (dict(num_experts=8, top_k=2, n_group=3), "num_experts=8 must be divisible by n_group=3"),
    (dict(num_experts=8, top_k=2, n_group=4, topk_group=5), "topk_group"),
    (dict(num_experts=8, top_k=4, n_group=4, topk_group=1), "topk_group=1 groups of 2 experts hold fewer than top_k=4"),
    (dict(num_experts=8, top_k=1, scoring="sigmoid", n_group=8), "two best experts"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=0), "routed_scaling_factor must be a finite number > 0"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=float("inf")), "routed_scaling_factor must be a finite"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=True), "routed_scaling_factor must be a finite"),
    (dict(num_experts=8, top_k=2, norm_topk_prob="no"), "norm_topk_prob"),
])
def test_bad_router_configs_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        RouterConfig(**kwargs)


def test_bad_router_and_expert_inputs_are_refused_by_name():
    config = RouterConfig(8, 2)
    with pytest.raises(ValueError, match=r"logits must be \[tokens, num_experts=8\], got shape \(4, 6\)"):
        route(jnp.zeros((4, 6)), config)
    with pytest.raises(ValueError, match="bias .* is for scoring='sigmoid'"):
        route(jnp.zeros((4, 8)), config, jnp.zeros(8))
    with pytest.raises(ValueError, match=r"bias must be \[num_experts=8\]"):
        route(jnp.zeros((4, 8)), RouterConfig(8, 2, "sigmoid"), jnp.zeros(4))
    w_gate, w_up, w_down = _expert_weights(np.random.default_rng(6))
    x, e, w = jnp.zeros((4, 32)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))
    with pytest.raises(ValueError, match="expert weights must be"):
        routed_experts_ragged(x, e, w, w_gate, w_up, w_down[:, :, :8])
    with pytest.raises(ValueError, match="experts and weights must both be"):
        routed_experts_dense(x, e, w[:, :1], w_gate, w_up, w_down)
    with pytest.raises(ValueError, match=r"x must be \[tokens, D\], got shape \(32,\)"):
        routed_experts_ragged(x[0], e, w, w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="experts must hold integer expert ids, got dtype float32"):
        routed_experts_ragged(x, e.astype(jnp.float32), w, w_gate, w_up, w_down)
    for fn in (routed_experts_ragged, routed_experts_dense):
        for bad in (-1, 8):
            with pytest.raises(ValueError, match=rf"experts must be ids in \[0, 8\), got ids from {min(bad, 0)}"):
                fn(x, e.at[0, 0].set(bad), w, w_gate, w_up, w_down)
    assert route(np.zeros((2, 8)).tolist(), config)[1].shape == (2, 2)  # lists are taken as arrays


def test_out_of_range_ids_under_jit_add_nothing_in_either_form():
    """Under jit the ids cannot be checked: an id outside [0, E) adds
    nothing, the same in the grouped and the one-hot form."""
    rng = np.random.default_rng(8)
    w_gate, w_up, w_down = _expert_weights(rng)
    x = jnp.asarray(rng.standard_normal((6, 32)).astype(np.float32))
    experts = jnp.array([[0, -1], [8, 3], [1, 2], [4, 5], [6, 7], [-3, 9]], jnp.int32)
    weights = jnp.full((6, 2), 0.5, jnp.float32)
    ragged = jax.jit(routed_experts_ragged)(x, experts, weights, w_gate, w_up, w_down)
    dense = jax.jit(routed_experts_dense)(x, experts, weights, w_gate, w_up, w_down)
    np.testing.assert_allclose(ragged, dense, rtol=1e-5, atol=1e-6)
    assert not np.asarray(ragged[5]).any()  # both ids out of range: nothing


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_a_non_finite_logit_or_bias_gives_nan_weights_never_a_silent_choice(scoring):
    config = RouterConfig(8, 2, scoring, 2, 1)
    logits = jnp.asarray(np.random.default_rng(9).standard_normal((3, 8)).astype(np.float32)).at[1, 4].set(jnp.nan)
    weights, _ = route(logits, config)
    assert np.isnan(weights[1]).all() and np.isfinite(np.asarray(weights)[[0, 2]]).all()
    if scoring == "sigmoid":
        weights, _ = route(logits.at[1, 4].set(0.0), config, jnp.zeros(8).at[3].set(jnp.inf))
        assert np.isnan(weights).all()


def test_moe_bench_times_both_forms(tmp_path):
    """experiments.kernels.moe_bench at toy size: a row per (experts, tokens), both forms timed."""
    from experiments.kernels import moe_bench

    rows = moe_bench.main(["--tokens", "1", "16", "--experts", "4", "--model-dim", "16", "--expert-dim", "8",
                           "--min-seconds", "0.01", "--out", str(tmp_path)])
    assert [(r["experts"], r["tokens"]) for r in rows] == [(4, 1), (4, 16)]
    assert all(r["ragged_ms"] > 0 and r["dense_ms"] > 0 for r in rows)
    assert "one-hot / ragged_dot" in (tmp_path / "moe_bench.md").read_text()


def test_routed_experts_picks_a_form_and_every_form_agrees():
    """``routed_experts``: "auto" is the one-hot dispatch on CPU (measured
    faster there, moe_bench); every form gives the same outputs; an
    unknown form is refused by name."""
    k = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(k[0], (5, 8))
    weights, ids = route(jax.random.normal(k[1], (5, 4)), RouterConfig(num_experts=4, top_k=2))
    w_gate, w_up = jax.random.normal(k[2], (4, 8, 6)), jax.random.normal(k[3], (4, 8, 6))
    w_down = jax.random.normal(k[4], (4, 6, 8))
    args = (x, ids, weights, w_gate, w_up, w_down)
    auto = routed_experts(*args)
    assert jax.default_backend() == "cpu"
    np.testing.assert_array_equal(auto, routed_experts_dense(*args))
    np.testing.assert_allclose(routed_experts(*args, impl="ragged"), auto, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl must be one of"):
        routed_experts(*args, impl="loop")
