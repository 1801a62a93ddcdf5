"""The server's command line, shared by launch.serve and helios-serve (launch.wrapper).

vLLM's flag names, with the project's older names as aliases, in vLLM's argument groups
(Frontend, ModelConfig, ParallelConfig, CacheConfig, SchedulerConfig, ...); ``--help`` shows
every default. Building and checking it imports no torch, so ``--help`` and a refused flag
answer at once. A refused command line is one ``helios: error: ...`` line (from rank 0 under
torchrun) and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn

from helios_logprobs.launch.arguments import add_runtime_arguments
from helios_logprobs.launch.signals import env_rank, say

GENERATION_CONFIG_DEFAULT = "auto"
"""--generation-config's default (runtime.http.protocol.defaults.FROM_MODEL, which imports
torch through ranks.model)."""
MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""--max-request-bytes' default (runtime.http.protocol.limits.DEFAULT_MAX_REQUEST_BYTES)."""
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "qwen3_coder")
"""--tool-call-parser's names (runtime.text.parsers.tool_parsers.TOOL_PARSERS: this module
imports no runtime code, so --help answers at once)."""
API_KEY_ENV = ("VLLM_API_KEY", "HELIOS_API_KEY")
"""Environment variables read for the API key when --api-key is not given (vLLM's first)."""

GROUPS: dict[str, tuple[str, ...]] = {
    # vLLM's group title: this server's flags in it (the first option string of each)
    "Frontend": ("--host", "--port", "--api-key", "--allowed-origins", "--allowed-methods",
                 "--allowed-headers", "--allow-credentials", "--disable-uvicorn-access-log",
                 "--enable-log-requests", "--max-request-bytes", "--max-queued-requests",
                 "--enable-auto-tool-choice", "--tool-call-parser"),
    "ModelConfig": ("--model", "--revision", "--dtype", "--served-model-name", "--seed",
                    "--max-model-len", "--max-logprobs", "--logprobs-mode",
                    "--generation-config",
                    "--no-logprobs", "--prompt-logprobs", "--batch-invariant"),
    "ParallelConfig": ("--tensor-parallel-size", "--collective-timeout", "--heartbeat-timeout"),
    "CacheConfig": ("--gpu-memory-utilization",),
    "SchedulerConfig": ("--max-num-seqs", "--max-num-batched-tokens", "--chunk-size",
                        "--completion-token-capacity"),
    "SpeculativeConfig": ("--speculative-tokens", "--ngram-min", "--ngram-max"),
    "StructuredOutputsConfig": ("--reasoning-parser", "--reasoning-config"),
}
OWN_GROUP = "Helios"
"""Flags vLLM has no counterpart for."""
DESCRIPTIONS = {
    "Frontend": "The OpenAI-compatible HTTP server.",
    "ModelConfig": "The checkpoint and what the core computes from it.",
    "ParallelConfig": "Tensor parallelism (one process per rank).",
    "CacheConfig": "Device memory.",
    "SchedulerConfig": "Request slots and the tokens of one step.",
    "SpeculativeConfig": "Speculative decoding with prompt-lookup (n-gram) proposals.",
    "StructuredOutputsConfig": "Reasoning (thinking) delimiters.",
    OWN_GROUP: "This server's own settings.",
}


class HeliosParser(argparse.ArgumentParser):
    """An ArgumentParser whose refusal is one ``helios: error: ...`` line from rank 0."""

    def error(self, message: str) -> NoReturn:
        refuse_and_exit(f"{message} (see {self.prog} --help)")


def refuse_and_exit(message: str) -> NoReturn:
    """One ``helios: error: <message>`` line (rank 0 alone) and exit status 2."""
    if env_rank() == 0:
        say(f"error: {message}")
    sys.stdout.flush()
    sys.exit(2)


class ShowDefaults(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Grouped:
    """Passed to add_runtime_arguments as the parser: each flag lands in its vLLM group."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.group_of = {flag: title for title, flags in GROUPS.items() for flag in flags}
        self.groups = {title: parser.add_argument_group(title)
                       for title in (*GROUPS, OWN_GROUP)}
        self.actions: dict[str, argparse.Action] = {}

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        title = next((self.group_of[n] for n in names if n in self.group_of), OWN_GROUP)
        action = self.groups[title].add_argument(*names, **kwargs)
        self.actions[action.dest] = action
        self.groups[title].description = DESCRIPTIONS[title]
        return action


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError('expected a JSON list of strings, e.g. \'["*"]\'')
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def serve_parser(prog: str = "helios_logprobs.launch.serve",
                 description: str | None = None) -> HeliosParser:
    p = HeliosParser(prog=prog, description=description, formatter_class=ShowDefaults)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as --model (vllm serve MODEL)")
    grouped = _Grouped(p)
    add_runtime_arguments(grouped)  # type: ignore[arg-type]
    add = grouped.add_argument
    add("--host", default="127.0.0.1", help="the address to listen on")
    add("--port", type=int, default=8000, help="0: any free port (printed)")
    add("--api-key", nargs="+", default=None,
        help="answer /v1 routes only with `Authorization: Bearer <one of these keys>` (401 "
             "otherwise); /health, /ping, /metrics, /version and the tokenizer routes stay "
             "open, as in vLLM. default: $VLLM_API_KEY or $HELIOS_API_KEY, else no key")
    add("--allowed-origins", type=_json_list, default=["*"], help="CORS: JSON list")
    add("--allowed-methods", type=_json_list, default=["*"], help="CORS: JSON list")
    add("--allowed-headers", type=_json_list, default=["*"], help="CORS: JSON list")
    add("--allow-credentials", action="store_true", help="CORS: allow credentials")
    add("--disable-uvicorn-access-log", action="store_true",
        help="no access log line per HTTP request")
    add("--enable-log-requests", action="store_true",
        help="log each admitted request (route, model, prompt tokens, choices, parameters)")
    add("--max-request-bytes", type=_positive, default=MAX_REQUEST_BYTES,
        help="largest request body in bytes; a larger one gets HTTP 413")
    add("--generation-config", default=GENERATION_CONFIG_DEFAULT,
        help="sampling defaults for fields a request leaves unset (temperature, top_p, top_k, "
             "min_p, repetition_penalty; max_new_tokens caps max_tokens): 'auto' reads the "
             "model's generation_config.json, 'vllm' uses neutral ones, or a directory "
             "holding generation_config.json")
    add("--max-queued-requests", type=_positive, default=None,
        help="engine requests (one per choice) waiting or running at once; beyond it HTTP 429 "
             "with Retry-After; default: 4 x --max-num-seqs")
    add("--enable-auto-tool-choice", action="store_true",
        help="parse tool calls out of the output when a request's tool_choice is 'auto' (the "
             "default with tools); needs --tool-call-parser")
    add("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
        help="how tool calls are written in the output: hermes (<tool_call>{...}</tool_call>), "
             "llama3_json ({\"name\": ..., \"parameters\": ...}; ...) or qwen3_coder "
             "(<tool_call><function=NAME><parameter=P>...)")
    add("--api-server-count", "-asc", type=_positive, default=1, metavar="N",
        help="API server processes (HTTP, tokenization, detokenization, the wire format) "
             "beside the engine core, sharing the port (vLLM's --api-server-count)")
    add("--tensor-parallel-size", "-tp", "--tp", type=_positive, default=None, metavar="N",
        help="ranks (processes): helios-serve starts torchrun with this many; default: 1, or "
             "under a bare torchrun its world size")
    p.set_defaults(model_action=grouped.actions.get("model"))
    return p


def parse_serve_args(argv: list[str] | None = None, prog: str = "helios_logprobs.launch.serve",
                     description: str | None = None) -> argparse.Namespace:
    """The parsed command line: the positional model folded into --model, the API key from
    the environment when not given."""
    parser = serve_parser(prog, description)
    args = parser.parse_args(argv)
    action = args.model_action
    del args.model_action
    if args.model_tag is not None:
        model = action.type(args.model_tag) if action is not None and action.type else \
            args.model_tag
        if args.model is not None and str(args.model) != str(model):
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = model
    del args.model_tag
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.api_key is None:
        keys = [os.environ[name] for name in API_KEY_ENV if os.environ.get(name)]
        args.api_key = keys[:1] or None
    return args
