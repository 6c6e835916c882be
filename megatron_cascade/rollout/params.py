"""Sampling parameters of a rollout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of tokens whose probability (after
            temperature and top-k) reaches ``top_p``; 1.0 = off.
        top_k: keep the ``top_k`` most likely tokens; 0 = off.
        max_new_tokens: response length limit, in tokens.
        stop_token_ids: a response ends after any of these tokens (the token is kept in it).
        stop_strings: a response ends at the token that completes any of these strings in the
            decoded response text (the token is kept; the text is not cut).
        n: samples per prompt.
        seed: seed of the sampling generator; same seed, prompts and model -> same responses.
        ignore_eos: do not stop at the tokenizer's eos token (it stops by default).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    n: int = 1
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Tuples, so that the params are hashable and a list from a YAML config is accepted.
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(str(s) for s in self.stop_strings))
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n} must be >= 1")
        if any(not s for s in self.stop_strings):
            raise ValueError("SamplingParams.stop_strings must not contain an empty string")

    @property
    def greedy(self) -> bool:
        """Whether sampling is deterministic argmax."""
        return self.temperature == 0.0


# flash-attn 2's paged KV kernels take blocks of a multiple of this many tokens (flash-attn 3: any).
FLASH_ATTN2_BLOCK_MULTIPLE = 256


@dataclass(frozen=True)
class KVCacheConfig:
    """How much memory the paged KV cache of ``generate`` may hold (per rank).

    Attributes:
        kv_cache_bytes: the budget in bytes for this rank's KV blocks (its pipeline stage's layers,
            its tensor-parallel share of the KV heads); None: ``kv_cache_fraction`` of free memory.
        kv_cache_fraction: with ``kv_cache_bytes`` None, this fraction of the device's free memory
            when ``generate`` starts (``torch.cuda.mem_get_info``; on CPU of available RAM).
        block_size_tokens: tokens per KV block (Megatron's default 256; flash-attn 2 paged kernels
            need a multiple of 256 on GPU, FA3 any size).

        expected_response_fraction: the expected response length as a fraction of the response
            budget: sizes a hybrid model's request slots (each holds a Mamba state), as many as
            requests of that length fit beside their KV blocks.
        cuda_graphs: how many decode batch sizes to pad decode-only steps to (Megatron's
            ``num_cuda_graphs``: sizes spread up to the request limit, multiples of 8 and of the TP
            size); on a GPU a decode copy built with graphs (``rollout.parallel``) replays a CUDA
            graph captured once per size and ``generate`` call. None: eager steps, padded to the
            TP size only. Padding never changes a token (padding rows read the dummy block and are
            never sampled).
        reserve_full_response: admit a request only with blocks for its whole response budget,
            held until it finishes (no preemption ever; the baseline of ``benchmarks/generation.py``).
            False (default): blocks are taken as tokens are generated, and requests are preempted
            and recomputed when the pool runs out (``engine.py``); same tokens either way.
        share_prompt_blocks: a prompt's samples share its full KV blocks (one copy of the prompt's
            KV per group, not one per sample; ``block_allocator.py``). False: each sample gets a
            copy (the baseline of ``benchmarks/generation.py``); same tokens either way.

    Requests that do not fit wait until blocks free up; one that can never fit (its prompt plus its
    response budget needs more blocks than the whole budget) is refused with a ValueError naming
    the keys. Only what the call can use is allocated (never more than the budget).
    """

    kv_cache_bytes: Optional[int] = None
    kv_cache_fraction: float = 0.5
    block_size_tokens: int = 256
    expected_response_fraction: float = 0.5
    cuda_graphs: Optional[int] = None
    reserve_full_response: bool = False
    share_prompt_blocks: bool = True

    @classmethod
    def from_rollout(cls, rollout) -> "KVCacheConfig":
        """From a ``RolloutConfig`` (``rollout.kv_cache_bytes / kv_cache_fraction / kv_block_size_tokens``)."""
        return cls(kv_cache_bytes=rollout.kv_cache_bytes, kv_cache_fraction=rollout.kv_cache_fraction,
                   block_size_tokens=rollout.kv_block_size_tokens,
                   expected_response_fraction=rollout.expected_response_fraction,
                   cuda_graphs=rollout.cuda_graphs)

    def __post_init__(self) -> None:
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"rollout.kv_cache_bytes={self.kv_cache_bytes} must be > 0 (or null)")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"rollout.kv_cache_fraction={self.kv_cache_fraction} must be in (0, 1]")
        if not 0.0 < self.expected_response_fraction <= 1.0:
            raise ValueError(f"rollout.expected_response_fraction={self.expected_response_fraction} must be in (0, 1]")
        if self.cuda_graphs is not None and self.cuda_graphs < 1:
            raise ValueError(f"rollout.cuda_graphs={self.cuda_graphs} must be >= 1 (or null: no graphs)")
        if self.block_size_tokens < 1:
            raise ValueError(f"rollout.kv_block_size_tokens={self.block_size_tokens} must be >= 1")
