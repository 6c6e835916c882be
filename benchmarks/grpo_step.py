"""Seconds per whole GRPO step: our stage (Megatron-Core model) vs TRL's ``GRPOTrainer``, same shapes.

One step = generate G samples for each prompt, score them, build advantages (and reference log-probs
when ``kl_coef`` > 0), one optimizer step. Ours runs the real ``StageRunner._step`` of a GRPO stage
(gloo worker process, Megatron-Core CPU mode); TRL (when ``trl`` is importable; it is not a project
dependency) runs ``GRPOTrainer`` on a Hugging Face ``Qwen3ForCausalLM`` of the same shape with the same
tokenizer ids, prompts, reward, sampling and batch, in a subprocess of this run. Both use fp32 and the
same number of torch threads. Warm-up steps are excluded; the median over ``--steps`` is printed, with
our split into generation / rewards / train / other (batch building, metric reductions), the fastest
step, and the process CPU seconds per step (steadier than wall time on a shared machine).

Shapes (``--size``):
    small: 4 layers x 256 hidden (Qwen3-like: GQA 4/2 heads, qk-norm, SwiGLU 768, RoPE), vocab 103
           (builtin:char, padded to 128), 2 prompts x 8 samples, 16-token prompts, <= 32 new tokens,
           one micro-batch of 16.
    large: 8 layers x 512 hidden (8/4 heads, SwiGLU 1536), otherwise the same.

Usage: ``python benchmarks/grpo_step.py [--size small] [--steps 10] [--rounds 3] [--floors] [--profile ours.prof]``;
with TRL installed elsewhere: ``PYTHONPATH=/path/to/trl_site python benchmarks/grpo_step.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {
    "small": dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2),
    "large": dict(num_layers=8, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8, num_query_groups=4),
}
PROMPTS, SAMPLES, MAX_NEW_TOKENS, SEED = 2, 8, 32, 1234
# Learning rate 0: both policies keep their initial weights, so every step samples the same amount of
# work (the optimizer still runs in full). With lr > 0 ours learns to stop early within a few steps
# (rollout.overlong_policy=zero rewards only finished responses; TRL rewards truncated ones too) and
# would time shorter responses than TRL.
LR = 0.0
# Two instructions that random text follows about a quarter / three quarters of the time: most groups
# get different rewards (85-92% informative in our runs); TRL trains on every group, ours drops the
# rows of uninformative ones (rollout.filter_uninformative_groups) from the training step.
INSTRUCTIONS = [{"id": "punctuation:no_comma", "kwargs": {}},
                {"id": "keywords:letter_frequency", "kwargs": {"letter": "e", "let_frequency": 1,
                                                               "let_relation": "at least"}}]
WORDS = ["sun", "fox", "egg", "tree", "moon", "cat", "sky", "rain", "wind", "leaf", "star", "frog"]


def prompt_texts(count: int = 64) -> list[str]:
    """12-character prompts (16 tokens with the chat template's 4 special tokens)."""
    return [f"write {WORDS[i % len(WORDS)]} {i:02d}"[:12] for i in range(count)]


def _write_config(folder: str, size: str, kl_coef: float) -> str:
    data = os.path.join(folder, "prompts.jsonl")
    with open(data, "w") as f:
        for text in prompt_texts():
            f.write(json.dumps({"prompt": text, "instructions": INSTRUCTIONS}) + "\n")
    m = SIZES[size]
    config = f"""
output_dir: {os.path.join(folder, "out")}
seed: {SEED}
tokenizer: builtin:char
model: {{num_layers: {m['num_layers']}, hidden_size: {m['hidden_size']}, ffn_hidden_size: {m['ffn_hidden_size']},
        num_attention_heads: {m['num_attention_heads']}, num_query_groups: {m['num_query_groups']},
        vocab_size: 103, max_position_embeddings: 128, qk_layernorm: true, rotary_base: 1000000.0}}
optimizer: {{lr: {LR}, clip_grad: 1.0}}
loss: {{kl_coef: {kl_coef}}}
training: {{micro_batch_size: {PROMPTS * SAMPLES}}}
rollout: {{temperature: 1.0, max_new_tokens: {MAX_NEW_TOKENS}}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
domains:
  instruction_following: {{train: {data}, reward: {{name: instruction_following}}}}
stages:
  - {{name: grpo, type: grpo, steps: 1000, prompts_per_step: {PROMPTS}, samples_per_prompt: {SAMPLES},
      domains: {{instruction_following: 1.0}}}}
"""
    path = os.path.join(folder, "grpo.yaml")
    with open(path, "w") as f:
        f.write(config)
    return path


# -- ours ------------------------------------------------------------------------------------------
def _ours_worker(config_path: str, warmup: int, steps: int, profile: str | None) -> list[dict]:
    """Build the GRPO stage and time ``warmup + steps`` calls of its ``_step``; returns timed metrics."""
    import cProfile

    from megatron_cascade.cascade.runner import build_context
    from megatron_cascade.cascade.stage import StageRunner
    from megatron_cascade.config import load_config, resolve_stage
    from megatron_cascade.model import initialize_model_parallel

    cfg = load_config(config_path)
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    runner = StageRunner(build_context(cfg), 0, resolve_stage(cfg, cfg.stages[0]))
    runner._build()
    for step in range(warmup):
        runner._step(step)
    profiler = cProfile.Profile() if profile else None
    out = []
    for step in range(warmup, warmup + steps):
        if profiler:
            profiler.enable()
        cpu = time.process_time()
        metrics = runner._step(step)
        metrics["cpu_s"] = time.process_time() - cpu
        if profiler:
            profiler.disable()
        out.append(metrics)
    if profiler:
        profiler.dump_stats(profile)
    return out


def run_ours(size: str, warmup: int, steps: int, kl_coef: float, profile: str | None) -> list[dict]:
    """The metrics of our timed steps (one fresh stage, ``warmup`` steps first)."""
    from megatron_cascade.testing import run_distributed

    with tempfile.TemporaryDirectory() as folder:
        path = _write_config(folder, size, kl_coef)
        return run_distributed(_ours_worker, 1, path, warmup, steps, profile, timeout_s=1800)[0]


def summarize_ours(metrics: list[dict]) -> dict:
    med = {k: statistics.median(m[k] for m in metrics)
           for k in ("time/step_s", "time/generation_s", "time/reward_s", "time/train_s", "cpu_s")}
    med["other"] = statistics.median(m["time/step_s"] - m["time/generation_s"] - m["time/reward_s"]
                                     - m["time/train_s"] for m in metrics)
    med["min_step_s"] = min(m["time/step_s"] for m in metrics)
    med["skipped"] = sum(m.get("skipped", 0.0) for m in metrics)
    med["lengths"] = [m["response/length_mean"] for m in metrics]
    med["informative"] = statistics.mean(m["groups/informative_frac"] for m in metrics)
    return med


# -- floors: the bare models, no trainer ------------------------------------------------------------
def _timed(fn, repeats: int) -> float:
    """Fastest of ``repeats`` calls, in ms (the least disturbed by other work on a shared machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _count_ops(fn) -> int:
    """Torch calls (ops and tensor methods) that one ``fn()`` makes."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def _model_floors(model, forward, decode_step, repeats: int) -> dict:
    """ms of a forward+backward of the training batch, and of one decode step, with its op count.

    ``forward(ids)`` returns [b, s, V] logits of ``model``; ``decode_step()`` runs one cached decode
    forward (``model`` in eval mode)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (PROMPTS * SAMPLES, 16 + MAX_NEW_TOKENS + 1), generator=gen)
    adv = torch.randn(PROMPTS * SAMPLES, 1, generator=gen)

    def train():
        logits = forward(ids[:, :-1]).float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(logprobs * adv).mean()).backward()

    train_ms = _timed(train, repeats)
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            decode_step()
        decode_ms = _timed(decode_step, 4 * repeats)
        decode_ops = _count_ops(decode_step)
    return {"train_ms": train_ms, "decode_ms": decode_ms, "decode_ops": decode_ops}


def _megatron_floors(size: str, repeats: int) -> dict:
    """Megatron-Core GPTModel (CPU mode, static KV cache): no DDP, optimizer, engine or sampler."""
    import torch
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_cascade.config import ModelConfig, ParallelConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=SEED)
    model = build_gpt_model(ModelConfig(vocab_size=103, max_position_embeddings=512, qk_layernorm=True,
                                        rotary_base=1e6, **SIZES[size]), ParallelConfig())
    rows = PROMPTS * SAMPLES
    context = StaticInferenceContext(rows, 512)
    token = torch.full((rows, 1), 7)

    def decode_step():
        position = torch.full((rows, 1), context.sequence_len_offset)
        model(token, position, None, inference_context=context, runtime_gather_output=True)
        context.increment_sequence_len_offset(1)

    def forward(ids):
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)

    return _model_floors(model, forward, decode_step, repeats)


def _hf_floors(size: str, repeats: int) -> dict:
    """Hugging Face Qwen3ForCausalLM (what TRL trains) with its DynamicCache."""
    import torch
    from transformers import DynamicCache

    model = _hf_model(size)
    rows = PROMPTS * SAMPLES
    cache = DynamicCache(config=model.config)
    token = torch.full((rows, 1), 7)

    def decode_step():
        model(token, past_key_values=cache, use_cache=True)

    return _model_floors(model, lambda ids: model(input_ids=ids).logits, decode_step, repeats)


def run_floors(size: str, repeats: int) -> None:
    from megatron_cascade.testing import run_distributed

    megatron = run_distributed(_megatron_floors, 1, size, repeats, timeout_s=900)[0]
    hf = run_distributed(_hf_floors, 1, size, repeats, cpu_mode=False, timeout_s=900)[0]
    decodes = MAX_NEW_TOKENS + 1
    print(f"floors (bare models, fastest of {repeats}): forward+backward of the {PROMPTS * SAMPLES} x "
          f"{16 + MAX_NEW_TOKENS} batch / one decode step of {PROMPTS * SAMPLES} rows (torch calls in it)")
    for name, f in (("Megatron-Core", megatron), ("HF Qwen3", hf)):
        print(f"  {name:<14} train {f['train_ms']:7.1f} ms   decode {f['decode_ms']:6.2f} ms ({f['decode_ops']} calls)"
              f"   train + {decodes} decodes = {(f['train_ms'] + decodes * f['decode_ms']) / 1e3:.3f} s")


# -- TRL -------------------------------------------------------------------------------------------
def _hf_char_tokenizer():
    """A Hugging Face fast tokenizer with exactly ``builtin:char``'s ids (specials included)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from megatron_cascade.tokenizers.char import CHARACTERS, SPECIAL_TOKENS

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(CHARACTERS))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>",
                                  additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"])
    tok.padding_side = "left"
    return tok


def _hf_model(size: str):
    """A random ``Qwen3ForCausalLM`` of our model's shape (vocabulary padded to 128 like ours), fp32."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    m = SIZES[size]
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=128, hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_query_groups"], head_dim=m["hidden_size"] // m["num_attention_heads"],
        max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=1, eos_token_id=2, pad_token_id=0))


def _chat_text(prompt: str) -> str:
    """The prompt as builtin:char's chat template writes it (the HF tokenizer maps it to the same ids)."""
    return "<bos><|user|>" + prompt + "<eos><|assistant|>"


def _trl_reward(completions, instructions, **_):
    from megatron_cascade.rewards.ifeval import instruction_following_reward

    return [instruction_following_reward(c, {"instructions": i}) for c, i in zip(completions, instructions)]


def _trl_main(size: str, warmup: int, steps: int, kl_coef: float) -> None:
    """Runs in a subprocess: TRL GRPOTrainer, prints per-step seconds as JSON on the last line."""
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model = _hf_model(size)
    texts = [_chat_text(p) for p in prompt_texts()]
    # An explicit fingerprint: ``datasets`` would otherwise hash the table with dill, which fails on
    # some pyarrow versions; nothing here is cached.
    table = InMemoryTable.from_pydict({"prompt": texts, "instructions": [INSTRUCTIONS] * len(texts)})
    data = Dataset(table, fingerprint="grpo-step-benchmark")
    times: list[float] = []
    cpu_times: list[float] = []
    generation: list[float] = []
    lengths: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)
            cpu_times.append(time.process_time() - self.cpu)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
            max_completion_length=MAX_NEW_TOKENS, temperature=1.0, learning_rate=LR, max_grad_norm=1.0,
            beta=kl_coef, max_steps=warmup + steps, use_cpu=True, bf16=False, fp16=False, report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=SEED, dataloader_num_workers=0,
            adam_beta2=0.95, lr_scheduler_type="constant")
        trainer = GRPOTrainer(model=model, reward_funcs=_trl_reward, args=args, train_dataset=data,
                              processing_class=_hf_char_tokenizer(), callbacks=[StepTimer()])
        inner = trainer._generate_and_score_completions

        def timed(*a, **kw):
            start = time.perf_counter()
            result = inner(*a, **kw)
            generation.append(time.perf_counter() - start)
            return result

        trainer._generate_and_score_completions = timed
        trainer.train()
    print(json.dumps({"step": times[warmup:], "cpu": cpu_times[warmup:], "generation": generation[warmup:],
                      "lengths": lengths[warmup:]}))


def run_trl(size: str, warmup: int, steps: int, kl_coef: float) -> dict:
    """TRL's timed steps in a subprocess: lists of step / CPU / generation seconds and response lengths."""
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", "--size", size, "--warmup", str(warmup),
           "--steps", str(steps), "--kl-coef", str(kl_coef)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize_trl(runs: list[dict]) -> dict:
    step = [t for r in runs for t in r["step"]]
    return {"time/step_s": statistics.median(step), "min_step_s": min(step),
            "cpu_s": statistics.median(t for r in runs for t in r["cpu"]),
            "time/generation_s": statistics.median(t for r in runs for t in r["generation"]),
            "lengths": [x for r in runs for x in r["lengths"]]}


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of ours and TRL (fresh runs)")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0: a reference model's log-probs too")
    parser.add_argument("--profile", help="write a cProfile of our timed steps to this file")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL even when it is importable")
    parser.add_argument("--floors", action="store_true",
                        help="also time the bare models (Megatron-Core vs HF Qwen3): train and decode per call")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        _trl_main(args.size, args.warmup, args.steps, args.kl_coef)
        return
    import torch

    m = SIZES[args.size]
    print(f"GRPO step, {args.size}: {m['num_layers']} layers x {m['hidden_size']}, {PROMPTS} prompts x {SAMPLES} "
          f"samples, <= {MAX_NEW_TOKENS} new tokens, fp32, {torch.get_num_threads()} threads; "
          f"median of {args.rounds} x {args.steps} steps, each run after {args.warmup} warm-up")
    if args.floors:
        run_floors(args.size, args.steps)
    with_trl = not args.no_trl and importlib.util.find_spec("trl") is not None
    ours_runs: list[dict] = []
    trl_runs: list[dict] = []
    # Alternating rounds: load from other work on a shared machine hits both sides alike.
    for _ in range(args.rounds):
        ours_runs += run_ours(args.size, args.warmup, args.steps, args.kl_coef, args.profile)
        if with_trl:
            trl_runs.append(run_trl(args.size, args.warmup, args.steps, args.kl_coef))
    ours = summarize_ours(ours_runs)
    print(f"ours: {ours['time/step_s']:.3f} s/step, min {ours['min_step_s']:.3f}, CPU {ours['cpu_s']:.3f} s "
          f"(generation {ours['time/generation_s']:.3f}, rewards {ours['time/reward_s']:.3f}, train "
          f"{ours['time/train_s']:.3f}, other {ours['other']:.3f}; skipped steps {ours['skipped']:.0f}, "
          f"informative groups {ours['informative']:.0%})")
    print(f"      mean response tokens per step: {_fmt(ours['lengths'])}")
    if not with_trl:
        print("TRL: not importable (or --no-trl); ours only")
        return
    trl = summarize_trl(trl_runs)
    print(f"TRL:  {trl['time/step_s']:.3f} s/step, min {trl['min_step_s']:.3f}, CPU {trl['cpu_s']:.3f} s "
          f"(generation + scoring {trl['time/generation_s']:.3f})")
    print(f"      mean response tokens per step: {_fmt(trl['lengths'])}")
    print(f"speed-up ours vs TRL: {trl['time/step_s'] / ours['time/step_s']:.2f}x (median), "
          f"{trl['min_step_s'] / ours['min_step_s']:.2f}x (min)")

if __name__ == "__main__":
    main()
