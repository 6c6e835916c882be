"""``convert compare``: run a Hugging Face checkpoint and our Megatron checkpoint on the same tokens.

The HF model is loaded with transformers (``AutoModelForCausalLM``, CPU, float32, eager attention);
the Megatron one through our model builder (``build_gpt_model``: GPTModel or the hybrid MambaModel,
whichever ``model_config.json`` names) with its weights cast to float32, in Megatron-Core's CPU mode
when there is no GPU. Both see the same random token ids; the result is the largest absolute
difference of their logits over the real (unpadded) vocabulary. Works for every family the
converter supports, since it only needs transformers to know the HF architecture.

Memory: both models in float32 at once (8 bytes per parameter), so check large models on a
machine with room for that, or a reduced copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_cascade.config.model import ModelConfig, ParallelConfig
from megatron_cascade.models.errors import ConversionError


@dataclass(frozen=True)
class Comparison:
    """Result of ``compare_checkpoints``: logits of [1, tokens, vocab] from both sides."""

    max_abs_diff: float  # largest |HF logit - Megatron logit| over tokens x vocab
    max_abs_logit: float  # largest |HF logit|, for scale
    argmax_agreement: float  # share of positions whose top-1 token is the same
    tokens: int
    vocab_size: int
    architecture: str  # the HF architecture compared

    def summary(self) -> str:
        """One line for the CLI."""
        return (f"{self.architecture}: max abs logit difference {self.max_abs_diff:.3e} over {self.tokens} tokens x "
                f"{self.vocab_size} vocab (largest |logit| {self.max_abs_logit:.3g}, "
                f"top-1 agreement {self.argmax_agreement:.1%})")


def sample_tokens(vocab_size: int, count: int, seed: int = 0) -> torch.Tensor:
    """[1, count] random token ids in ``[0, vocab_size)`` (int64), the same for a given ``seed``."""
    if count < 1:
        raise ConversionError(f"--tokens={count} must be >= 1")
    return torch.randint(0, vocab_size, (1, count), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> tuple[torch.Tensor, str]:
    """([batch, seq, vocab] float32 logits, architecture) of the HF checkpoint in ``hf_dir`` on ``tokens``."""
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    except (OSError, ValueError, KeyError) as exc:
        raise ConversionError(f"transformers could not load {hf_dir}: {exc}") from exc
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return logits, type(model).__name__


def megatron_logits(ckpt_dir: str, tokens: torch.Tensor, parallel: ParallelConfig,
                    model: ModelConfig | None = None) -> torch.Tensor:
    """[batch, seq, vocab] float32 logits (vocab padding stripped, gathered over TP) of our checkpoint.

    Megatron's parallel state must be initialised at ``parallel`` (``megatron_runtime`` for TP=1); every
    rank returns the same logits. ``model`` defaults to the checkpoint's ``model_config.json``; the
    model is built in float32 whatever precision the checkpoint was saved in.
    """
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_cascade.convert.megatron_to_hf import load_model_config
    from megatron_cascade.model import build_gpt_model, load_model_weights

    cfg = model or load_model_config(ckpt_dir)
    cfg = replace(cfg, precision="fp32", fp8=replace(cfg.fp8, format=None))
    net = build_gpt_model(cfg, parallel).eval()
    load_model_weights(net, ckpt_dir, cfg)
    device = next(net.parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(net(tokens, positions, None))
    return logits[..., : cfg.vocab_size].float().cpu()


def compare_checkpoints(hf_dir: str, ckpt_dir: str, *, tokens: int = 32, seed: int = 0) -> Comparison:
    """Run the HF checkpoint ``hf_dir`` and the Megatron checkpoint ``ckpt_dir`` on ``tokens`` random ids.

    One process, TP=1. Raises ``ConversionError`` when the two have different vocabularies.
    """
    from megatron_cascade.convert.hf_files import read_hf_config
    from megatron_cascade.convert.megatron_to_hf import load_model_config
    from megatron_cascade.convert.runtime import megatron_runtime

    hf_config, path = read_hf_config(hf_dir)
    cfg = load_model_config(ckpt_dir)
    if int(hf_config.get("vocab_size", -1)) != cfg.vocab_size:
        raise ConversionError(f"{path} has vocab_size={hf_config.get('vocab_size')} but {ckpt_dir} has "
                              f"{cfg.vocab_size}: these are not the same model")
    ids = sample_tokens(cfg.vocab_size, tokens, seed)
    reference, architecture = hf_logits(hf_dir, ids)
    with megatron_runtime():
        ours = megatron_logits(ckpt_dir, ids, ParallelConfig(), cfg)
    return Comparison(
        max_abs_diff=(reference - ours).abs().max().item(),
        max_abs_logit=reference.abs().max().item(),
        argmax_agreement=(reference.argmax(-1) == ours.argmax(-1)).float().mean().item(),
        tokens=tokens,
        vocab_size=cfg.vocab_size,
        architecture=architecture,
    )
