"""Config mapping, tensor transforms, safetensors I/O and input errors (no Megatron runtime)."""

import json
import os

import pytest
import torch

from megatron_cascade.config import ModelConfig
from megatron_cascade.convert import ConversionError, hf_config_from_model, model_config_from_hf, validate_layout
from megatron_cascade.models.qwen3 import FAMILY as QWEN3
from megatron_cascade.convert.safetensors_io import INDEX_FILE, SafetensorsReader, ShardedSafetensorsWriter
from megatron_cascade.convert.tensor_maps import pack_qkv, pad_vocab, strip_vocab, unpack_qkv

QWEN3_HF = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "max_position_embeddings": 40960, "rope_scaling": None,
    "use_sliding_window": False, "sliding_window": None, "hidden_act": "silu", "attention_bias": False,
}


def test_qwen3_config_maps_every_field():
    family, cfg = model_config_from_hf(QWEN3_HF, "config.json")
    assert family is QWEN3
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads) == (28, 1024, 3072, 16)
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.vocab_size, cfg.rotary_base) == (8, 128, 151936, 1e6)
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and cfg.tie_embeddings and cfg.precision == "bf16"
    back = hf_config_from_model(cfg, family, QWEN3_HF, "bf16")
    assert back == QWEN3_HF


def test_moe_config_maps_router_and_experts():
    hf = dict(QWEN3_HF, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=128,
              num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
              mlp_only_layers=[])
    _, cfg = model_config_from_hf(hf, "config.json")
    assert (cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.ffn_hidden_size) == (128, 8, 768)
    assert cfg.moe.router_pre_softmax is False  # norm_topk_prob: softmax over the top-k
    _, cfg = model_config_from_hf(dict(hf, norm_topk_prob=False), "config.json")
    assert cfg.moe.router_pre_softmax is True


@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 2}, "decoder_sparse_step"),
])
def test_unsupported_features_are_refused(change, needle):
    with pytest.raises(ConversionError, match=needle) as info:
        model_config_from_hf(dict(QWEN3_HF, **change), "/some/config.json")
    assert "/some/config.json" in str(info.value)


def test_layout_validation_names_the_flag():
    cfg = ModelConfig(num_layers=2, num_attention_heads=4, num_query_groups=2)
    validate_layout(cfg, tp=2, pp=2)
    with pytest.raises(ConversionError, match="--tp=4 does not divide .*num_query_groups"):
        validate_layout(cfg, tp=4)
    with pytest.raises(ConversionError, match="--pp=3"):
        validate_layout(cfg, pp=3)
    with pytest.raises(ConversionError, match="--ep=2 needs an MoE model"):
        validate_layout(cfg, ep=2)


def test_qkv_packing_is_per_query_group_and_invertible():
    cfg = ModelConfig(hidden_size=8, num_attention_heads=4, num_query_groups=2, kv_channels=2)
    q, k, v = torch.arange(8.0).reshape(8, 1), 100 + torch.arange(4.0).reshape(4, 1), 200 + torch.arange(4.0)[:, None]
    qkv = pack_qkv(q, k, v, cfg)
    # group 0: q heads 0,1 (rows 0-3), k head 0, v head 0; then group 1
    assert qkv[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    for a, b in zip(unpack_qkv(qkv, cfg), (q, k, v)):
        assert torch.equal(a, b)
    bias = pack_qkv(q[:, 0], k[:, 0], v[:, 0], cfg)
    assert torch.equal(bias, qkv[:, 0])


def test_vocab_padding_round_trip():
    w = torch.randn(200, 4)
    padded = pad_vocab(w, 256)
    assert padded.shape == (256, 4) and padded[200:].abs().sum() == 0
    assert torch.equal(strip_vocab(padded, 200), w)


def _write(directory, tensors, max_bytes):
    writer = ShardedSafetensorsWriter(str(directory), max_bytes)
    for name, t in tensors.items():
        writer.add(name, t)
    return writer.finish()


def test_writer_shards_with_index_and_reader_reads_back(tmp_path):
    tensors = {f"t{i}": torch.randn(10, 10, dtype=torch.bfloat16 if i % 2 else torch.float32) for i in range(5)}
    names = _write(tmp_path, tensors, 500)
    assert len(names) > 1 and os.path.isfile(tmp_path / INDEX_FILE)
    reader = SafetensorsReader(str(tmp_path))
    for name, t in tensors.items():
        assert torch.equal(reader.get(name), t) and reader.get(name).dtype == t.dtype
    assert reader.total_parameters() == 500
    assert _write(tmp_path / "one", tensors, 10**9) == ["model.safetensors"]


def test_missing_shard_is_named(tmp_path):
    names = _write(tmp_path, {f"t{i}": torch.randn(10, 10) for i in range(3)}, 500)
    os.remove(tmp_path / names[1])
    with pytest.raises(ConversionError, match=f"names shard {names[1]}, which is missing"):
        SafetensorsReader(str(tmp_path))


def test_truncated_file_is_named(tmp_path):
    (name,) = _write(tmp_path, {"a": torch.randn(100, 10)}, 10**9)
    path = tmp_path / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=f"{path} is truncated"):
        SafetensorsReader(str(tmp_path))


def test_index_json_is_hf_format(tmp_path):
    _write(tmp_path, {f"t{i}": torch.randn(10, 10) for i in range(3)}, 500)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 3 * 400 and set(index["weight_map"]) == {"t0", "t1", "t2"}
