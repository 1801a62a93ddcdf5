"""Fixed widths shared by every reduction backend, the exchanges and the decoder."""

from __future__ import annotations

EXPORT_K = 20
"""Natural alternatives a core exports (K)."""

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""vLLM's --logprobs-mode values (vllm/config/model.py LogprobsMode); the first is the default
and the contract's rule (ranks/step/reduce.py serves the others)."""

MAX_TOKEN_IDS = 128
"""Caller-selected token IDs per request (logprob_token_ids)."""

PAYLOAD_WORDS = 2 + 2 * MAX_TOKEN_IDS
"""int32 words per packed position: chosen id, chosen FP32 bits, 128 (id, FP32 bits) pairs."""

TILE_CANDIDATES = 32
"""Best sort keys each vocabulary tile (and each shard) keeps."""

EXCHANGE1_WORDS = 3
"""Exchange 1, per position per rank: [shard max FP32 bits, shard exp mass FP32 bits, shard
entropy term FP32 bits]. The statistics launches write words 0-1; word 2 (kernels/entropy.py)
is written only for rows whose entropy is asked for and read only for them."""

ENTROPY_WORD = 2
"""Exchange 1's word holding the shard's sum of e^(x - max) (x - max) (kernels/entropy.py)."""

EXCHANGE2_WORDS = 1 + MAX_TOKEN_IDS
"""Exchange 2, per position per rank: word 0 = the chosen token's raw logit FP32 bits (only
the owning rank's word is read); words 1.. = either the shard's best 32 sort keys as (high,
low) int32 halves (natural mode, 64 words, the rest zero) or, for a slot with selected IDs,
one raw-logit FP32 bit word per selected ID in caller order (only the owner's word is read)."""

PROMPT_K = 20
"""Alternatives per scored prompt row."""

PROMPT_ROW_WORDS = 3 + 2 * PROMPT_K
"""prompt_logprobs row: actual id, raw FP32 bits, actual rank, 20 (id, FP32 bits) pairs."""

PROMPT_TARGET_ID = 0
PROMPT_TARGET_BITS = 1
PROMPT_RANK = 2
PROMPT_FIRST_PAIR = 3

PROMPT_BLOCK_ROWS = 64
"""Hidden rows projected through the LM head shard at a time: the only scoring logit matrix
is [64, local_vocabulary]."""

PROMPT_EXCHANGE_WORDS = 64
"""Prompt scoring exchanges carry 64 int32 words per row per rank."""

CHOSEN_ID = 0
CHOSEN_BITS = 1
FIRST_PAIR = 2

assert EXCHANGE1_WORDS <= 256 and EXCHANGE2_WORDS <= 256
