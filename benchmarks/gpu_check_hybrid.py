"""GPU check of the hybrid (Mamba-2 / attention / MoE) model: what the CPU harness cannot run.

    python benchmarks/gpu_check_hybrid.py [--json FILE]

Needs a CUDA device, Transformer Engine, mamba-ssm (>= 2.2.6) and causal-conv1d (>= 1.5.3) (a NeMo /
PyTorch container); without CUDA it exits with status 2. Checks, printed as PASS / FAIL / SKIP:
  hybrid_checkpoint  a tiny "M*ME" model written on CPU (a subprocess without CUDA: local spec, the
                     torch Mamba kernels of ops/mamba_reference.py, fp32) loads into the GPU model
                     (megatron-core's TE mamba_stack_spec, mamba_ssm's Triton kernels, fp32): logits
                     agree to 1e-3 relative (the kernels' float order differs from the torch scan);
  hybrid_generation  greedy generation with the SSM state cached in the static context equals a full
                     recompute (same tokens; log-probs within 1e-3), prompts of several lengths;
  hybrid_recompute   model.recompute=full vs none: gradients within 1e-4 relative, each layer runs
                     twice, peak MiB of both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def model_config():
    from megatron_cascade.config.model import HybridConfig, ModelConfig, MoEConfig

    return ModelConfig(
        architecture="hybrid", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
        vocab_size=1024, ffn_hidden_size=512, max_position_embeddings=512, position_embedding_type="none",
        activation="squared_relu", norm_epsilon=1e-5, init_method_std=0.05,
        hybrid=HybridConfig(layer_pattern="M*ME", mamba_head_dim=64, mamba_num_groups=2, mamba_state_dim=64,
                            mamba_chunk_size=64),
        moe=MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=256, shared_expert_intermediate_size=512,
                      router_score_function="sigmoid", router_enable_expert_bias=True, router_topk_scaling_factor=2.5))


def probe_tokens():
    import torch

    return torch.randint(0, 1024, (2, 200), generator=torch.Generator().manual_seed(0))


def write_cpu_checkpoint(out_dir: str) -> None:
    """Runs in a subprocess with no CUDA device (local spec, torch Mamba kernels, fp32)."""
    import torch

    from megatron_cascade.cascade.runtime import init_distributed, shutdown_distributed
    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.model import initialize_model_parallel, save_model_weights
    from megatron_cascade.model.builder import build_model

    init_distributed()
    try:
        initialize_model_parallel(ParallelConfig(), seed=1)
        cfg = model_config()
        model = build_model(cfg, ParallelConfig()).eval()
        save_model_weights(model, os.path.join(out_dir, "weights"), cfg)
        tokens = probe_tokens()
        with torch.no_grad():
            logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        torch.save({"tokens": tokens, "logits": logits.float()}, os.path.join(out_dir, "reference.pt"))
    finally:
        shutdown_distributed()


def run_cpu_writer(out_dir: str) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--write-cpu-checkpoint", out_dir],
                         env=env, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"CPU checkpoint writer failed ({res.returncode}):\n{res.stderr[-3000:]}")


class StreamedResults(list):
    """A result list that prints each result, and (with a path) rewrites the JSON, as it is appended:
    a hang or the outer timeout loses only the check that was running."""

    def __init__(self, json_path: Optional[str] = None) -> None:
        super().__init__()
        self.path = Path(json_path) if json_path else None

    def append(self, result: dict) -> None:
        super().append(result)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
        if self.path is not None:
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text(json.dumps(list(self), indent=2))
            os.replace(partial, self.path)


def run_checks(ref_dir: str, results: Optional[list] = None) -> list[dict]:
    """Every hybrid check in turn, each result appended to ``results`` (a ``StreamedResults`` prints
    it at once) as it ends; a check that raises is that check's FAIL."""
    import torch

    from megatron_cascade.cascade.runtime import init_distributed
    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.model import initialize_model_parallel, load_model_weights
    from megatron_cascade.model.builder import build_model
    from megatron_cascade.model.parallel import transformer_engine_available
    from megatron_cascade.rollout import SamplingParams, generate
    from megatron_cascade.tokenizers import CharTokenizer

    init_distributed()
    initialize_model_parallel(ParallelConfig(), seed=1)
    cfg = model_config()
    model = build_model(cfg, ParallelConfig()).eval()
    spec = "TE mamba_stack_spec" if transformer_engine_available() else "local spec"
    load_model_weights(model, os.path.join(ref_dir, "weights"), cfg)
    ref = torch.load(os.path.join(ref_dir, "reference.pt"))
    device = next(model.parameters()).device
    tokens = ref["tokens"].to(device)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1], device=device).expand_as(tokens), None).float().cpu()
    err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    results = [] if results is None else results
    results.append(dict(name="hybrid_checkpoint", status="PASS" if err < 1e-3 else "FAIL",
                        detail=f"CPU-written hybrid weights in the {spec} model", max_rel_logit_err=err))
    tok = CharTokenizer()
    prompts = [tok.encode(t) for t in ("abc", "what is 2+2?", "Write a haiku about rain.\nGo")]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, n=2, ignore_eos=True)
    full = generate(model, prompts, params, tokenizer=tok, use_kv_cache=False)
    # The paged engine (mamba_ssm / causal_conv1d varlen and state-update kernels, Megatron's Triton
    # tensor ops), with a budget that preempts, and the static context: each against the recompute.
    from megatron_cascade.rollout import KVCacheConfig
    from megatron_cascade.rollout.kv_budget import kv_layout

    layout = kv_layout(model, 256, tp=1)
    tight = KVCacheConfig(kv_cache_bytes=2 * layout.block_bytes + 2 * layout.state_bytes, block_size_tokens=256)
    for name, kwargs in (("hybrid_generation", {}), ("hybrid_generation_tight", {"kv_cache": tight}),
                         ("hybrid_generation_static", {"static_batches": True})):
        try:
            cached = generate(model, prompts, params, tokenizer=tok, use_kv_cache=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported as this check's FAIL
            results.append(dict(name=name, status="FAIL", detail=f"{type(exc).__name__}: {str(exc)[:400]}"))
            continue
        same = [s.response_ids for s in cached] == [s.response_ids for s in full]
        lp = max(abs(a - b) for s, r in zip(cached, full) for a, b in zip(s.response_logprobs, r.response_logprobs))
        results.append(dict(name=name, status="PASS" if same and lp < 1e-3 else "FAIL",
                            detail=f"{kwargs or 'paged'} vs full recompute, greedy", same_tokens=same,
                            max_logprob_diff=lp, stats=vars(cached.stats) if cached.stats else None))
    try:
        results.append(check_hybrid_recompute())
    except Exception as exc:  # noqa: BLE001 - reported as this check's FAIL
        results.append(dict(name="hybrid_recompute", status="FAIL", detail=f"{type(exc).__name__}: {str(exc)[:400]}"))
    return results


def check_hybrid_recompute() -> dict:
    """recompute=full vs none on the hybrid model (TE spec, mamba_ssm kernels on GPU): one forward +
    backward of the same tokens; every gradient agrees and each layer runs twice under full."""
    from dataclasses import replace

    import torch

    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.model.builder import build_model

    cfg = model_config()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = probe_tokens().to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    grads, calls, peaks, state = {}, {}, {}, None
    for recompute in ("none", "full"):
        model = build_model(replace(cfg, recompute=recompute, recompute_num_layers=1), ParallelConfig()).train()
        if state is None:
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(state)
        count = [0]
        hooks = [layer.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
                 for layer in model.decoder.layers]
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        logits = model(tokens, positions, None).float()
        torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).sum().backward()
        if device == "cuda":
            peaks[recompute] = torch.cuda.max_memory_allocated() / 2**20
        for hook in hooks:
            hook.remove()
        calls[recompute] = count[0]
        grads[recompute] = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                            if p.grad is not None}
        del model, logits
    err = max(((grads["full"][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
              for n, g in grads["none"].items())
    layers = len(cfg.hybrid.layer_pattern)
    ok = grads["none"].keys() == grads["full"].keys() and err < 1e-4 and calls == {"none": layers, "full": 2 * layers}
    result = dict(name="hybrid_recompute", status="PASS" if ok else "FAIL",
                  detail="recompute=full vs none, forward+backward", max_rel_grad_err=err,
                  layer_calls_none=calls["none"], layer_calls_full=calls["full"])
    if peaks:
        result.update(peak_mib_none=peaks["none"], peak_mib_full=peaks["full"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--write-cpu-checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # smoke test of the script
    args = parser.parse_args()
    if args.write_cpu_checkpoint:
        write_cpu_checkpoint(args.write_cpu_checkpoint)
        return 0
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device: nothing to check")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        run_cpu_writer(tmp)
        if not torch.cuda.is_available():
            from megatron_cascade.cpu_runtime import enable_cpu_mode

            enable_cpu_mode()
        else:
            from megatron_cascade.torch_kernels import enable_torch_kernels

            print(f"torch stand-ins for: {', '.join(enable_torch_kernels()) or 'nothing (every kernel package imports)'}")
        results = run_checks(tmp, StreamedResults(args.json))
    return 0 if all(r["status"] == "PASS" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
