"""Shared by the scoring-request tests: lm-evaluation-harness's own reading of a response and
transformers' continuation loglikelihood (the oracle)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from tests.checkpoints import hf_logprobs
from tests.server.helpers import locked


def lm_eval_parse_logprobs(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness `local-completions` (lm_eval/models/openai_completions.py,
    LocalCompletionsAPI.parse_logprobs, v0.4.x; lm_eval itself is not a test dependency):
    the continuation's loglikelihood is the sum of token_logprobs[ctxlen:-1] (the last entry
    is taken to be the one generated token's), greedy when each of those values is the
    maximum of its top_logprobs dict."""
    assert ctxlen > 0, "Context length must be greater than 0"
    logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = True
    for tok, top in zip(tokens_logprobs, top_logprobs, strict=False):
        if tok != max(top.values()):
            is_greedy = False
            break
    return logprobs, is_greedy


def hf_continuation(model_dir: Path, context: list[int], continuation: list[int]
                    ) -> tuple[float, bool, int]:
    """transformers on the same checkpoint (FP32 log_softmax): the continuation's
    loglikelihood, whether it is greedy, and the greedy token after it."""
    full = [*context, *continuation]
    rows = hf_logprobs(model_dir, full)
    picks = range(len(context), len(full))
    total = sum(float(rows[i - 1, full[i]]) for i in picks)
    greedy = all(int(rows[i - 1].argmax()) == full[i] for i in picks)
    return total, greedy, int(rows[-1].argmax())


def scoring_body(model: str, prompts: list[list[int]], **extra) -> dict:
    """What local-completions sends for loglikelihood requests (token-id prompts)."""
    return {"model": model, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234, **extra}


def smollm2_oracle_dir(gguf: Path) -> Path:
    """The oracle's copy of a GGUF file: transformers' own dequantization (FP32) saved once as
    an HF folder under the temporary directory (loading the GGUF takes transformers ~40 s),
    reused by later sessions while the file is unchanged."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / f"helios-smollm2-{key}"
    with locked(Path(tempfile.gettempdir()) / "helios-smollm2.lock"):
        if (target / "config.json").exists():
            return target
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are plain FP32 tensors now; only the quantizer's mark forbids saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        building = Path(tempfile.mkdtemp(prefix="helios-smollm2-", dir=target.parent))
        model.save_pretrained(building)
        tokenizer.save_pretrained(building)
        building.rename(target)
    return target
