"""Checkpoint conversion benchmark. Run: ``python benchmarks/convert.py [--family llama|nemotron_h] [--hidden 1024]``.

Writes a random Hugging Face checkpoint — Llama-style by default (~480M parameters: 24 layers,
hidden 1024, FFN 4096, 16 heads / 8 KV heads, vocab 50000), or with ``--family nemotron_h`` a
Nemotron-H hybrid in Nemotron-3-Nano's proportions (``--pattern``, default 12 layers MEMEM*EMEMEM*
scaled to hidden 1024: Mamba-2 32 heads x 64 in 4 groups, 32 experts top-4 of 512 + a shared one of
1024) — in 1 GB safetensors shards, then times ``hf-to-megatron`` and ``megatron-to-hf`` in fp32 and
bf16, each in a fresh subprocess, and reports its peak RSS (the process's VmHWM high-water mark)
against the checkpoint's size on disk and its largest decoder layer (conversion streams one layer
at a time). The runtime alone (torch + Megatron-Core imported, CPU mode on) is the baseline RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from megatron_cascade.convert.hf_files import write_hf_config
from megatron_cascade.convert.safetensors_io import ShardedSafetensorsWriter

# The peak is this process's VmHWM (Linux), reset to the current RSS after the imports. Not
# ru_maxrss: Linux carries the parent's high-water mark into a forked child (and across exec).
_CHILD = r"""
import json, sys, time
from megatron_cascade.convert.cli import main
from megatron_cascade.convert.runtime import hide_gpus, megatron_runtime

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

hide_gpus()
with megatron_runtime():  # import and initialise everything first: the baseline
    pass
baseline = status_kib("VmRSS") * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS counter to the current RSS
start = time.perf_counter()
status = main(sys.argv[1:])
seconds = time.perf_counter() - start
peak = status_kib("VmHWM") * 1024
print(json.dumps({"status": status, "seconds": seconds, "peak_rss": peak, "baseline_rss": baseline}))
"""


def write_random_llama(out_dir: str, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int,
                       dtype: torch.dtype, shard_size: str) -> int:
    """A random Llama checkpoint in ``out_dir`` (written a layer at a time); returns its parameter count."""
    hd = hidden // heads
    writer = ShardedSafetensorsWriter(out_dir, int(float(shard_size.rstrip("GB")) * 10**9))
    total = 0

    def add(name: str, *shape: int) -> None:
        nonlocal total
        writer.add(name, (torch.randn(*shape) * 0.02).to(dtype))
        total += torch.Size(shape).numel()

    add("model.embed_tokens.weight", vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", hidden)
        add(p + "post_attention_layernorm.weight", hidden)
        add(p + "self_attn.q_proj.weight", heads * hd, hidden)
        add(p + "self_attn.k_proj.weight", kv_heads * hd, hidden)
        add(p + "self_attn.v_proj.weight", kv_heads * hd, hidden)
        add(p + "self_attn.o_proj.weight", hidden, heads * hd)
        add(p + "mlp.gate_proj.weight", ffn, hidden)
        add(p + "mlp.up_proj.weight", ffn, hidden)
        add(p + "mlp.down_proj.weight", hidden, ffn)
    add("model.norm.weight", hidden)
    add("lm_head.weight", vocab, hidden)
    writer.finish()
    write_hf_config(out_dir, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
    })
    return total


def write_random_nemotron_h(out_dir: str, *, pattern: str, hidden: int, heads: int, kv_heads: int, vocab: int,
                            experts: int, dtype: torch.dtype, shard_size: str) -> tuple[int, int]:
    """A random nemotron_h checkpoint in ``out_dir`` in Nemotron-3-Nano's proportions (Mamba-2 heads of
    64, state 128, 8 heads a group; experts of hidden x 0.69, the shared one twice that; attention heads
    of 128); returns (parameter count, bytes of the largest decoder layer)."""
    hd, m_heads, m_hd, state = 128, hidden // 32, 64, 128
    groups, d_inner, ffn = max(1, m_heads // 8), hidden // 32 * 64, int(hidden * 0.69) // 64 * 64
    conv = d_inner + 2 * groups * state
    writer = ShardedSafetensorsWriter(out_dir, int(float(shard_size.rstrip("GB")) * 10**9))
    counts = {"total": 0, "layer": 0}

    def add(name: str, *shape: int, keep_fp32: bool = False) -> None:
        t = torch.randn(*shape) * 0.02
        t = t if keep_fp32 else t.to(dtype)
        writer.add(name, t)
        counts["total"] += t.numel()
        counts["layer"] += t.numel() * t.element_size()

    add("backbone.embeddings.weight", vocab, hidden)
    largest = 0
    for i, symbol in enumerate(pattern):
        p, counts["layer"] = f"backbone.layers.{i}.", 0
        add(p + "norm.weight", hidden)
        if symbol == "M":
            for name, shape in (("in_proj.weight", (2 * d_inner + 2 * groups * state + m_heads, hidden)),
                                ("conv1d.weight", (conv, 1, 4)), ("conv1d.bias", (conv,)), ("A_log", (m_heads,)),
                                ("D", (m_heads,)), ("dt_bias", (m_heads,)), ("norm.weight", (d_inner,)),
                                ("out_proj.weight", (hidden, d_inner))):
                add(p + "mixer." + name, *shape)
        elif symbol == "*":
            for name, rows in (("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)):
                add(f"{p}mixer.{name}.weight", rows, hidden)
            add(p + "mixer.o_proj.weight", hidden, heads * hd)
        else:  # E: routed experts, router with its fp32 correction bias, one shared expert
            add(p + "mixer.gate.weight", experts, hidden)
            add(p + "mixer.gate.e_score_correction_bias", experts, keep_fp32=True)
            for e in range(experts):
                add(f"{p}mixer.experts.{e}.up_proj.weight", ffn, hidden)
                add(f"{p}mixer.experts.{e}.down_proj.weight", hidden, ffn)
            add(p + "mixer.shared_experts.up_proj.weight", 2 * ffn, hidden)
            add(p + "mixer.shared_experts.down_proj.weight", hidden, 2 * ffn)
        largest = max(largest, counts["layer"])
    add("backbone.norm_f.weight", hidden)
    add("lm_head.weight", vocab, hidden)
    writer.finish()
    write_hf_config(out_dir, {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern), "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hd, "intermediate_size": ffn, "mamba_num_heads": m_heads,
        "mamba_head_dim": m_hd, "ssm_state_size": state, "n_groups": groups, "conv_kernel": 4, "chunk_size": 128,
        "n_routed_experts": experts, "num_experts_per_tok": 4, "moe_intermediate_size": ffn,
        "moe_shared_expert_intermediate_size": 2 * ffn, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "vocab_size": vocab, "tie_word_embeddings": False,
        "max_position_embeddings": 8192, "torch_dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
    })
    return counts["total"], largest


def largest_llama_layer(hidden: int, ffn: int, heads: int, kv_heads: int, dtype: torch.dtype) -> int:
    """Bytes of one Llama decoder layer."""
    hd = hidden // heads
    params = 2 * hidden + (2 * heads + 2 * kv_heads) * hd * hidden + 3 * ffn * hidden
    return params * torch.empty((), dtype=dtype).element_size()


def dir_bytes(path: str) -> int:
    """Bytes of all files under ``path``."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def run_child(args: list[str]) -> dict:
    """Run one conversion CLI in a fresh process; its time (s), peak RSS and baseline RSS (bytes)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"conversion {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("llama", "nemotron_h"), default="llama")
    parser.add_argument("--pattern", default="MEMEM*EMEMEM*", help="nemotron_h layer pattern (M * E)")
    parser.add_argument("--experts", type=int, default=32, help="nemotron_h routed experts per MoE layer")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50000)
    parser.add_argument("--shard-size", default="1GB", help="HF shard size of the input and output (GB)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a new temp dir, removed)")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="convert-bench-")
    gib = 2**30
    print(f"{'dtype':<6}{'direction':<16}{'params':>8}{'on disk':>10}{'layer':>10}{'time':>9}{'peak RSS':>10}"
          f"{'baseline':>10}{'peak-base':>11}")
    try:
        for name in args.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            base = os.path.join(work, name)
            if args.family == "nemotron_h":
                n, layer = write_random_nemotron_h(f"{base}/hf", pattern=args.pattern, hidden=args.hidden,
                                                   heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                                                   experts=args.experts, dtype=dtype, shard_size=args.shard_size)
            else:
                n = write_random_llama(f"{base}/hf", layers=args.layers, hidden=args.hidden, ffn=args.ffn,
                                       heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, dtype=dtype,
                                       shard_size=args.shard_size)
                layer = largest_llama_layer(args.hidden, args.ffn, args.heads, args.kv_heads, dtype)
            runs = [
                ("hf-to-megatron", ["hf-to-megatron", "--hf", f"{base}/hf", "--out", f"{base}/meg"], f"{base}/hf"),
                ("megatron-to-hf", ["megatron-to-hf", "--ckpt", f"{base}/meg", "--out", f"{base}/back",
                                    "--max-shard-size", args.shard_size], f"{base}/meg"),
            ]
            for label, cli_args, src in runs:
                r = run_child(cli_args)
                print(f"{name:<6}{label:<16}{n / 1e6:>7.0f}M{dir_bytes(src) / gib:>8.2f}GiB{layer / gib:>7.2f}GiB"
                      f"{r['seconds']:>8.1f}s"
                      f"{r['peak_rss'] / gib:>7.2f}GiB{r['baseline_rss'] / gib:>7.2f}GiB"
                      f"{(r['peak_rss'] - r['baseline_rss']) / gib:>8.2f}GiB", flush=True)
            shutil.rmtree(base)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"total benchmark time {time.perf_counter() - started:.0f}s")
