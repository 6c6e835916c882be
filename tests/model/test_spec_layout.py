"""Weights independent of the layer spec: local-spec checkpoints carry the Transformer Engine (TE) names.

``fixtures/te_spec_keys.json`` holds the sharded-state-dict keys and shapes megatron-core 0.16.1's TE
spec gives a tiny dense and a tiny MoE model (qk_layernorm, GQA), written by hand from the spec code
(its "derivation" says from where; TE cannot be installed on CPU). One single-process worker builds
the local-spec models and: saves them (keys must equal the fixture); loads a checkpoint written
under exactly the fixture's names, TE ``_extra_state`` objects included (weights must come back
bit-identical); loads and reshards a checkpoint in the local-spec naming of earlier versions; and
loads checkpoints with a tensor missing, reshaped or added (must fail naming it).
"""

import json
import os

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "te_spec_keys.json")


def _fixture() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)["models"]


def _model_config(raw: dict) -> ModelConfig:
    raw = dict(raw)
    moe = MoEConfig(**raw.pop("moe")) if "moe" in raw else MoEConfig()
    return ModelConfig(**raw, moe=moe)


# ---- worker helpers (run inside the gloo worker) ----

def _checkpoint_keys(ckpt_dir: str) -> tuple[dict, dict]:
    """({tensor key: global shape}, {_extra_state key: global shape}) stored in a distributed checkpoint."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    tensors, objects = {}, {}
    for entry in load_sharded_metadata(ckpt_dir).values():
        into = objects if isinstance(entry, ShardedObject) else tensors
        into[entry.key] = list(entry.global_shape)
    return tensors, objects


def _write_model_config(ckpt_dir: str, cfg: ModelConfig) -> None:
    from megatron_cascade.convert.dist_writer import write_model_config

    write_model_config(ckpt_dir, cfg)


def _save_raw(sharded_state_dict: dict, ckpt_dir: str, cfg: ModelConfig) -> None:
    """A weights directory holding exactly ``sharded_state_dict`` (no renaming)."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir)
    dist_checkpointing.save(sharded_state_dict, ckpt_dir)
    _write_model_config(ckpt_dir, cfg)


def _te_named_state(spec: dict, prefix: str = "") -> dict:
    """Whole tensors under the fixture's TE names (random, norms included) and TE's "no FP8" _extra_state.

    TE serialises an ``_extra_state`` without FP8 metadata as an empty uint8 tensor (one per stacked
    index). Keys get ``prefix`` (NeMo 2: ``module.``); dict keys of objects carry their index after "/".
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    gen = torch.Generator().manual_seed(11)
    state = {}
    for key, shape in spec["tensors"].items():
        key = prefix + key
        state[key] = ShardedTensor.from_rank_offsets(key, torch.randn(shape, generator=gen), replica_id=0)
    for key, shape in spec["extra_state"].items():
        key = prefix + key
        for index in torch.cartesian_prod(*[torch.arange(n) for n in shape]).reshape(-1, len(shape)).tolist():
            state[f"{key}/{index}"] = ShardedObject(key, torch.empty(0, dtype=torch.uint8), tuple(shape),
                                                    tuple(index), replica_id=0)
    return state


NEMO_MOE_YAML = """\
config:
  _target_: nemo.collections.llm.gpt.model.qwen3.Qwen3MoEConfig30B_A3B
  num_layers: 2
  hidden_size: 32
  ffn_hidden_size: 48
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 8
  vocab_size: 200
  qk_layernorm: true
  num_moe_experts: 4
  moe_router_topk: 2
  moe_ffn_hidden_size: 24
"""


def _import_te_named_nemo_moe(spec: dict, nemo_dir: str, out_dir: str) -> dict:
    """A NeMo-2-style directory whose ``weights/`` hold TE names under ``module.``, imported; the import's tensors."""
    from megatron.core import dist_checkpointing

    from megatron_cascade.convert import nemo2_to_megatron

    os.makedirs(f"{nemo_dir}/weights")
    os.makedirs(f"{nemo_dir}/context")
    dist_checkpointing.save(_te_named_state(spec, prefix="module."), f"{nemo_dir}/weights")
    with open(f"{nemo_dir}/context/model.yaml", "w") as f:
        f.write(NEMO_MOE_YAML)
    nemo2_to_megatron(nemo_dir, out_dir)
    return dist_checkpointing.load_plain_tensors(out_dir)


def _fresh_model(cfg: ModelConfig):
    """A local-spec model with every parameter zero (whatever it holds later came from a checkpoint)."""
    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.model import build_gpt_model

    model = build_gpt_model(cfg, ParallelConfig())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _load_error(model, ckpt_dir: str, cfg: ModelConfig) -> str | None:
    from megatron_cascade.model import CheckpointError, load_model_weights

    try:
        load_model_weights(model, ckpt_dir, cfg)
    except CheckpointError as exc:
        return str(exc)
    return None


def spec_layout_worker(tmp: str, fixture: dict) -> dict:
    """World size 1: everything the tests below check, per model kind."""
    from megatron.core import dist_checkpointing

    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.convert import reshard
    from megatron_cascade.convert.dist_writer import placement_of
    from megatron_cascade.convert.runtime import build_skeleton, megatron_runtime
    from megatron_cascade.model import build_gpt_model, load_model_weights, save_model_weights

    out = {}
    with megatron_runtime():
        for kind, spec in fixture.items():
            cfg, res, base = _model_config(spec["config"]), {}, os.path.join(tmp, kind)
            model = build_gpt_model(cfg, ParallelConfig())
            original = _params(model)
            # 1. what save_model_weights writes, and what the converter would write
            save_model_weights(model, f"{base}/saved", cfg)
            res["saved"] = _checkpoint_keys(f"{base}/saved")
            res["converter"] = {placement_of(e).key: list(placement_of(e).global_shape)
                                for e in build_skeleton(cfg).tensors.values()}
            # 2. a checkpoint under exactly the TE names loads, and saves back bit-identical
            te_state = _te_named_state(spec)
            _save_raw(te_state, f"{base}/te", cfg)
            written = {k: v.data for k, v in te_state.items() if "/" not in k}
            loaded = _fresh_model(cfg)
            load_model_weights(loaded, f"{base}/te", cfg)
            save_model_weights(loaded, f"{base}/te_resaved", cfg)
            resaved = dist_checkpointing.load_plain_tensors(f"{base}/te_resaved")
            res["te_round_trip_diff"] = sorted(k for k in written if not torch.equal(written[k], resaved.get(k)))
            layer = loaded.decoder.layers[1]
            res["input_norm_from_fused_key"] = torch.equal(
                layer.input_layernorm.weight, written["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][1])
            norm_key = ("decoder.layers.pre_mlp_layernorm.weight" if cfg.moe.num_experts
                        else "decoder.layers.mlp.linear_fc1.layer_norm_weight")
            res["pre_mlp_norm_from_te_key"] = torch.equal(layer.pre_mlp_layernorm.weight, written[norm_key][1])
            # 3. a checkpoint in the local-spec naming of earlier versions still loads, and reshards to TE names
            _save_raw(model.sharded_state_dict(), f"{base}/legacy", cfg)
            res["legacy_keys"] = _checkpoint_keys(f"{base}/legacy")[0]
            legacy = _fresh_model(cfg)
            load_model_weights(legacy, f"{base}/legacy", cfg)
            res["legacy_load_diff"] = sorted(k for k, v in _params(legacy).items() if not torch.equal(v, original[k]))
            reshard(f"{base}/legacy", f"{base}/resharded")
            res["resharded_keys"] = _checkpoint_keys(f"{base}/resharded")[0]
            # 4. strict loading still catches real mismatches; missing _extra_state does not count
            res["errors"] = _strict_cases(model, cfg, base)
            # 5. a NeMo 2 (GPU, TE spec) MoE checkpoint imports with its weights
            if cfg.moe.num_experts:
                imported = _import_te_named_nemo_moe(spec, f"{base}/nemo", f"{base}/nemo_imported")
                res["nemo_import_diff"] = sorted(k for k in written if not torch.equal(written[k], imported.get(k)))
                res["nemo_import_keys"] = sorted(imported)
            out[kind] = res
    return out


def _strict_cases(model, cfg: ModelConfig, base: str) -> dict:
    """{case: CheckpointError text or None} for checkpoints that differ from ``model`` in one tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from megatron_cascade.model.spec_layout import canonical_sharded_state_dict

    def state():
        return canonical_sharded_state_dict(model.sharded_state_dict())

    cases = {}
    missing = state()
    missing.pop("decoder.layers.1.self_attention.linear_proj.weight")
    missing.pop("decoder.layers.0.self_attention.linear_proj.weight")
    added = state()
    added["extra"] = ShardedTensor.from_rank_offsets("decoder.layers.self_attention.linear_extra.weight",
                                                     torch.ones(2, 4), replica_id=0)
    reshaped = state()
    reshaped["decoder.final_layernorm.weight"] = ShardedTensor.from_rank_offsets(
        "decoder.final_layernorm.weight", torch.ones(cfg.hidden_size + 8), replica_id=0)
    no_extra_state = {k: v for k, v in state().items() if not isinstance(v, ShardedObject)}
    no_output = state()
    no_output.pop("output_layer.weight")  # read only by the last pipeline stage (see the two-rank test)
    for case, sd in (("missing", missing), ("added", added), ("reshaped", reshaped),
                     ("no_extra_state", no_extra_state), ("no_output", no_output)):
        _save_raw(sd, f"{base}/strict_{case}", cfg)
        cases[case] = _load_error(_fresh_model(cfg), f"{base}/strict_{case}", cfg)
    return cases


def parallel_worker(tmp: str, fixture: dict) -> dict:
    """World size 2: the TE-named checkpoints at TP=2 (dense) / EP=2 (MoE) save back bit-identical;
    a checkpoint lacking a tensor only the last pipeline stage reads fails on both PP=2 ranks."""
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights
    from megatron_cascade.model import save_model_weights

    out = {}
    layouts = {"dense": ParallelConfig(tensor_model_parallel_size=2),
               "moe": ParallelConfig(expert_model_parallel_size=2)}
    for kind, spec in fixture.items():
        cfg, base = _model_config(spec["config"]), os.path.join(tmp, kind)
        initialize_model_parallel(layouts[kind], seed=3)
        model = build_gpt_model(cfg, layouts[kind])
        load_model_weights(model, f"{base}/te", cfg)
        save_model_weights(model, f"{base}/te_parallel", cfg)
        parallel_state.destroy_model_parallel()
        written = dist_checkpointing.load_plain_tensors(f"{base}/te")
        resaved = dist_checkpointing.load_plain_tensors(f"{base}/te_parallel")
        out[f"{kind}_diff"] = sorted(k for k in spec["tensors"] if not torch.equal(written[k], resaved.get(k)))
    cfg, pp2 = _model_config(fixture["dense"]["config"]), ParallelConfig(pipeline_model_parallel_size=2)
    initialize_model_parallel(pp2, seed=3)
    out["pp2_error"] = _load_error(build_gpt_model(cfg, pp2), os.path.join(tmp, "dense", "strict_no_output"), cfg)
    parallel_state.destroy_model_parallel()
    return out


# ---- tests ----

@pytest.fixture(scope="module")
def spec_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def results(spec_tmp):
    return run_distributed(spec_layout_worker, 1, spec_tmp, _fixture(), timeout_s=300)[0]


@pytest.fixture(scope="module")
def parallel_results(spec_tmp, results):
    return run_distributed(parallel_worker, 2, spec_tmp, _fixture(), timeout_s=300)


KINDS = ("dense", "moe")


@pytest.mark.parametrize("kind", KINDS)
def test_local_spec_checkpoint_has_exactly_the_te_tensor_names(results, kind):
    tensors, extra_state = results[kind]["saved"]
    expected = _fixture()[kind]
    assert tensors == expected["tensors"]
    # Local linears store (empty) _extra_state under TE's keys; TE norms have ones local norms lack.
    assert set(extra_state) <= set(expected["extra_state"])
    assert all(extra_state[k] == expected["extra_state"][k] for k in extra_state)


@pytest.mark.parametrize("kind", KINDS)
def test_converter_writes_te_names(results, kind):
    assert results[kind]["converter"] == _fixture()[kind]["tensors"]


@pytest.mark.parametrize("kind", KINDS)
def test_te_named_checkpoint_loads_into_local_spec_bit_identical(results, kind):
    res = results[kind]
    assert res["te_round_trip_diff"] == []
    assert res["input_norm_from_fused_key"] and res["pre_mlp_norm_from_te_key"]


def test_legacy_local_names_differ_from_te_only_in_the_moe_pre_mlp_norm(results):
    assert results["dense"]["legacy_keys"] == _fixture()["dense"]["tensors"]
    legacy, te = set(results["moe"]["legacy_keys"]), set(_fixture()["moe"]["tensors"])
    assert legacy - te == {"decoder.layers.mlp.linear_fc1.layer_norm_weight"}
    assert te - legacy == {"decoder.layers.pre_mlp_layernorm.weight"}


@pytest.mark.parametrize("kind", KINDS)
def test_legacy_local_spec_checkpoint_still_loads_and_reshards_to_te_names(results, kind):
    assert results[kind]["legacy_load_diff"] == []
    assert results[kind]["resharded_keys"] == _fixture()[kind]["tensors"]


@pytest.mark.parametrize("kind", KINDS)
def test_strict_load_names_the_mismatching_tensor(results, kind):
    errors = results[kind]["errors"]
    assert "lack" in errors["missing"] and "decoder.layers.self_attention.linear_proj.weight" in errors["missing"]
    assert "does not have" in errors["added"] and "decoder.layers.self_attention.linear_extra.weight" in errors["added"]
    assert "another shape" in errors["reshaped"] and "decoder.final_layernorm.weight" in errors["reshaped"]
    assert errors["no_extra_state"] is None  # _extra_state carries no weights: absent is fine


def test_te_named_nemo2_moe_checkpoint_imports_bit_identical(results):
    """NeMo 2 / Megatron-LM GPU checkpoints are TE-named: the MoE pre_mlp_layernorm is read (not
    demanded under linear_fc1's name)."""
    assert results["moe"]["nemo_import_diff"] == []
    assert results["moe"]["nemo_import_keys"] == sorted(_fixture()["moe"]["tensors"])


@pytest.mark.parametrize("kind", KINDS)
def test_te_named_checkpoint_round_trips_at_tp2_or_ep2(parallel_results, kind):
    for rank in parallel_results:
        assert rank[f"{kind}_diff"] == []


def test_tensor_missing_on_one_pipeline_stage_fails_on_every_rank(results, parallel_results):
    """Only the last stage reads output_layer.weight; both ranks raise the same error (none waits in a collective)."""
    assert "output_layer.weight" in results["dense"]["errors"]["no_output"]
    errors = [rank["pp2_error"] for rank in parallel_results]
    assert errors[0] is not None and errors[0] == errors[1] and "output_layer.weight" in errors[0]


def test_legacy_key_maps_only_the_separate_pre_mlp_norm():
    from megatron_cascade.model.spec_layout import legacy_key

    assert legacy_key("decoder.layers.pre_mlp_layernorm.weight") == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    assert legacy_key("module.decoder.layers.3.pre_mlp_layernorm.bias") == (
        "module.decoder.layers.3.mlp.linear_fc1.layer_norm_bias")
    assert legacy_key("decoder.layers.mlp.linear_fc1.layer_norm_weight") is None
    assert legacy_key("decoder.layers.my_pre_mlp_layernorm.weight") is None


def test_canonical_naming_leaves_te_spec_entries_alone_and_fuses_unmapped_dense_norms():
    """A TE MoE layer is left as it is; a local MoE layer's norm moves to pre_mlp_layernorm; a dense
    layer from a local spec without megatron-core's keys map (e.g. a custom CPU norm) gets TE's fused names."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_cascade.model.spec_layout import canonical_sharded_state_dict

    def layer(**names):
        return {f"decoder.layers.0.{k.replace('__', '.')}": ShardedTensor.from_rank_offsets(
            f"decoder.layers.{v}", torch.ones(4), replica_id=0) for k, v in names.items()}

    def keys(sd):
        return {k: v.key for k, v in canonical_sharded_state_dict(sd).items()}

    te_moe = layer(self_attention__linear_qkv__weight="self_attention.linear_qkv.weight",
                   pre_mlp_layernorm__weight="pre_mlp_layernorm.weight", mlp__router__weight="mlp.router.weight")
    assert keys(te_moe) == {k: v.key for k, v in te_moe.items()}
    local_moe = layer(self_attention__linear_qkv__weight="self_attention.linear_qkv.weight",
                      pre_mlp_layernorm__weight="mlp.linear_fc1.layer_norm_weight",
                      mlp__router__weight="mlp.router.weight")
    assert keys(local_moe)["decoder.layers.0.pre_mlp_layernorm.weight"] == "decoder.layers.pre_mlp_layernorm.weight"
    untouched = local_moe["decoder.layers.0.pre_mlp_layernorm.weight"].key
    assert untouched == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    unmapped_dense = layer(input_layernorm__weight="input_layernorm.weight",
                           self_attention__linear_qkv__weight="self_attention.linear_qkv.weight",
                           pre_mlp_layernorm__bias="pre_mlp_layernorm.bias",
                           mlp__linear_fc1__weight="mlp.linear_fc1.weight")
    assert keys(unmapped_dense) == {
        "decoder.layers.0.input_layernorm.weight": "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_qkv.weight": "decoder.layers.self_attention.linear_qkv.weight",
        "decoder.layers.0.pre_mlp_layernorm.bias": "decoder.layers.mlp.linear_fc1.layer_norm_bias",
        "decoder.layers.0.mlp.linear_fc1.weight": "decoder.layers.mlp.linear_fc1.weight"}
