"""``megatron-cascade convert ...``: checkpoint conversion subcommands (and ``compare``, the check of one).

``register(subparsers)`` adds the ``convert`` command to the main CLI; every subcommand sets
``args.func``: called with ``args``, it returns an exit status (0, or 2 after printing a
``ConversionError`` as one line on stderr).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Callable

from megatron_cascade.models.errors import ConversionError

_LAYOUT_HELP = ("validated against the model config only: a distributed checkpoint loads at any "
                "TP/PP/EP layout, so nothing is resliced")


def _add_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help=f"tensor-parallel size ({_LAYOUT_HELP})")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (validated only)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (validated only)")


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from megatron_cascade.convert.hf_to_megatron import hf_to_megatron

    model = hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, precision=args.precision)
    print(f"wrote Megatron checkpoint {args.out} ({model.num_layers} layers, {model.precision}, "
          f"vocab {model.vocab_size} padded to {model.padded_vocab_size})")
    return 0


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from megatron_cascade.convert.megatron_to_hf import megatron_to_hf

    arch = megatron_to_hf(args.ckpt, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
    print(f"wrote Hugging Face checkpoint {args.out} ({arch})")
    return 0


def _reshard(args: argparse.Namespace) -> int:
    from megatron_cascade.convert.reshard import reshard

    reshard(args.ckpt, args.out, tp=args.tp, pp=args.pp, ep=args.ep)
    print(f"wrote {args.out}: valid for TP={args.tp} PP={args.pp} EP={args.ep} (and any other layout)")
    return 0


def _nemo2(args: argparse.Namespace) -> int:
    from megatron_cascade.convert.nemo2 import nemo2_to_megatron

    model = nemo2_to_megatron(args.nemo, args.out, tp=args.tp, pp=args.pp, ep=args.ep)
    print(f"wrote Megatron checkpoint {args.out} ({model.num_layers} layers) from NeMo 2 {args.nemo}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from megatron_cascade.convert.inspect import format_summary, inspect_checkpoint

    summary = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2, default=str))
    else:
        print(format_summary(summary, show_tensors=not args.no_tensors))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from megatron_cascade.convert.compare import compare_checkpoints

    if args.tolerance < 0:
        raise ConversionError(f"--tolerance={args.tolerance} must be >= 0")
    result = compare_checkpoints(args.hf, args.ckpt, tokens=args.tokens, seed=args.seed)
    print(result.summary())
    if result.max_abs_diff > args.tolerance:
        print(f"FAIL: the difference {result.max_abs_diff:.3e} is above --tolerance {args.tolerance:g}",
              file=sys.stderr)
        return 1
    print(f"OK: within --tolerance {args.tolerance:g}")
    return 0


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``fn`` on CPU (GPUs hidden) with a ``ConversionError`` turned into a one-line message on stderr and
    exit status 2."""

    @functools.wraps(fn)
    def wrapper(args: argparse.Namespace) -> int:
        from megatron_cascade.convert.runtime import hide_gpus

        hide_gpus()  # CPU work, also on a GPU node
        try:
            return fn(args)
        except ConversionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return wrapper


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``convert`` and its subcommands to an ``argparse`` subparsers object; returns its parser."""
    convert = subparsers.add_parser("convert", help="convert checkpoints: Hugging Face <-> Megatron, NeMo 2 import")
    sub = convert.add_subparsers(dest="convert_command", required=True)

    p = sub.add_parser("hf-to-megatron", help="Hugging Face (config.json + safetensors) -> Megatron dist checkpoint")
    p.add_argument("--hf", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="new (empty) output directory")
    _add_layout(p)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="embedding rows are zero-padded to a multiple of this (default 128)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="cast weights (default: config dtype)")
    p.set_defaults(func=_guarded(_hf_to_megatron))

    p = sub.add_parser("megatron-to-hf", help="Megatron dist checkpoint -> Hugging Face safetensors")
    p.add_argument("--ckpt", required=True, help="Megatron checkpoint directory (with model_config.json)")
    p.add_argument("--out", required=True, help="new (empty) output directory")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="cast tensors (default: stored dtype)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB (default 5GB)")
    p.set_defaults(func=_guarded(_megatron_to_hf))

    p = sub.add_parser("reshard", help="validated copy for a TP/PP/EP layout (dist checkpoints load at any layout)")
    p.add_argument("--ckpt", required=True, help="Megatron checkpoint directory (with model_config.json)")
    p.add_argument("--out", required=True, help="new (empty) output directory")
    _add_layout(p)
    p.set_defaults(func=_guarded(_reshard))

    p = sub.add_parser("nemo2-to-megatron", help="NeMo 2 checkpoint (context/ + weights/) -> Megatron checkpoint")
    p.add_argument("--nemo", required=True, help="NeMo 2 checkpoint directory")
    p.add_argument("--out", required=True, help="new (empty) output directory")
    _add_layout(p)
    p.set_defaults(func=_guarded(_nemo2))

    p = sub.add_parser("compare", help="run the HF and the Megatron checkpoint on the same tokens (CPU, fp32); "
                                        "exit 1 if the max abs logit difference is above --tolerance")
    p.add_argument("--hf", required=True, help="Hugging Face checkpoint directory (loaded with transformers)")
    p.add_argument("--ckpt", required=True, help="Megatron checkpoint directory (with model_config.json)")
    p.add_argument("--tokens", type=int, default=32, help="random token ids to run (default 32)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest accepted max abs logit difference "
                   "(default 1e-4: float32 conversions agree to ~1e-6; use ~1e-1 for a bf16 checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    p.set_defaults(func=_guarded(_compare))

    p = sub.add_parser("inspect", help="config, tensor names/shapes/dtypes and totals (metadata only)")
    p.add_argument("path", help="Hugging Face, Megatron or NeMo 2 checkpoint directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-tensors", action="store_true", help="summary only")
    p.set_defaults(func=_guarded(_inspect))
    return convert


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m megatron_cascade.convert <subcommand> ...``."""
    parser = argparse.ArgumentParser(prog="python -m megatron_cascade")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["convert", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)
