"""Checkpoint conversion benchmark. Run: ``python benchmarks/convert.py [--layers 24 --hidden 1024]``.

Writes a random Llama-style Hugging Face checkpoint (~480M parameters by default: 24 layers,
hidden 1024, FFN 4096, 16 heads / 8 KV heads, vocab 50000, 1 GB safetensors shards), then times
``hf-to-megatron`` and ``megatron-to-hf`` in fp32 and bf16, each in a fresh subprocess, and reports
its peak RSS (the process's VmHWM high-water mark) against the checkpoint's size on disk. The runtime
alone (torch + Megatron-Core imported, CPU mode on) is reported as the baseline RSS.
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
    print(f"{'dtype':<6}{'direction':<16}{'params':>8}{'on disk':>10}{'time':>9}{'peak RSS':>10}"
          f"{'baseline':>10}{'peak-base':>11}")
    try:
        for name in args.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            base = os.path.join(work, name)
            n = write_random_llama(f"{base}/hf", layers=args.layers, hidden=args.hidden, ffn=args.ffn,
                                   heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, dtype=dtype,
                                   shard_size=args.shard_size)
            runs = [
                ("hf-to-megatron", ["hf-to-megatron", "--hf", f"{base}/hf", "--out", f"{base}/meg"], f"{base}/hf"),
                ("megatron-to-hf", ["megatron-to-hf", "--ckpt", f"{base}/meg", "--out", f"{base}/back",
                                    "--max-shard-size", args.shard_size], f"{base}/meg"),
            ]
            for label, cli_args, src in runs:
                r = run_child(cli_args)
                print(f"{name:<6}{label:<16}{n / 1e6:>7.0f}M{dir_bytes(src) / gib:>8.2f}GiB{r['seconds']:>8.1f}s"
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
