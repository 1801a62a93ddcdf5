"""Joining the torchrun job: process group, this rank's shard, the control channel."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from collectives.control import ControlConfig, open_control
from collectives.groups import barrier, destroy, init_from_env, world_group
from ranks.step import RankStep
from ranks.worker import run_peer
from runtime.engine.bootstrap import build_engine, load_rank
from runtime.engine.config import RuntimeConfig
from runtime.engine.engine import Engine

log = logging.getLogger("launch")


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    """Serving options; every default is RuntimeConfig's (runtime/engine/config.py)."""
    d = RuntimeConfig.default
    p.add_argument("--model", type=Path, default=None,
                   help="local Hugging Face directory; default: the embedded tiny model")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--capacity", type=int, default=d("capacity"), help="physical request slots")
    p.add_argument("--max-model-len", type=int, default=d("max_model_len"),
                   help="default: the checkpoint's max_position_embeddings, at most 4096")
    p.add_argument("--chunk-size", type=int, default=d("chunk_size"),
                   help="prefill chunk in tokens")
    p.add_argument("--max-batched-tokens", type=int, default=d("max_batched_tokens"),
                   help="tokens per step; default: twice the larger of chunk size and capacity")
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
    p.add_argument("--collective-timeout", type=float, default=d("collective_timeout_s"),
                   help="seconds before a silent peer fails a collective")
    p.add_argument("--heartbeat-timeout", type=float, default=d("heartbeat_timeout_s"),
                   help="seconds without a heartbeat before a rank counts as lost")
    p.add_argument("--log-level", default="WARNING")


def runtime_config(args: argparse.Namespace, device: str) -> RuntimeConfig:
    model_dir = args.model
    if model_dir is None:
        from launch.tiny_model import ensure_tiny_model

        model_dir = ensure_tiny_model()
    backend = args.reduction_backend or ("triton" if device == "cuda" else "torch")
    return RuntimeConfig(
        model_dir=Path(model_dir),
        served_model_name=args.served_model_name,
        device=device,
        capacity=args.capacity,
        max_model_len=args.max_model_len,
        chunk_size=args.chunk_size,
        max_batched_tokens=args.max_batched_tokens,
        logprobs=not args.no_logprobs,
        max_logprobs=args.max_logprobs,
        completion_token_capacity=args.completion_token_capacity,
        reduction_backend=backend,
        collective_timeout_s=args.collective_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )


@dataclass
class Cluster:
    rank: int
    world: int
    group: object
    config: RuntimeConfig
    step: RankStep
    channel: object | None

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def run_peer(self) -> int:
        try:
            return run_peer(self.step, self.channel)
        finally:
            self.channel.close()
            destroy()

    def engine(self) -> Engine:
        broadcast = self.channel.broadcast if self.channel is not None else None
        engine = build_engine(self.config, self.step, broadcast).start()
        if self.channel is not None:
            threading.Thread(target=watch_peers, args=(self.channel, engine), daemon=True).start()
        return engine

    def close(self, engine: Engine | None) -> None:
        if engine is not None:
            engine.shutdown()
        if self.channel is not None:
            self.channel.shutdown("coordinator exiting")
        destroy()


def join(args: argparse.Namespace) -> Cluster:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not cuda:
        # Ranks on one host share its cores; oversubscribed BLAS threads are many times slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    topology = init_from_env(timeout_s=args.collective_timeout) if world > 1 else None
    group = world_group() if world > 1 else None
    rank = topology.rank if topology else 0
    if args.model is None:
        # Rank 0 builds the embedded model first; the others then find it cached (or, on
        # another node, build the identical deterministic checkpoint themselves).
        if rank == 0:
            runtime_config(args, "cpu")
        barrier(group)
    config = runtime_config(args, "cuda" if cuda else "cpu")
    step = load_rank(config, group)
    control = ControlConfig(heartbeat_timeout_s=config.heartbeat_timeout_s)
    channel = open_control(rank, world, config=control) if world > 1 else None
    return Cluster(rank, world, group, config, step, channel)


def watch_peers(channel, engine: Engine, grace_s: float = 2.0) -> None:
    """Fail every request and end the job when a peer stops answering."""
    while engine.healthy():
        dead = channel.dead_peers()
        if dead:
            engine.fail(f"peer rank(s) {list(dead)} stopped answering")
            log.error("peer rank(s) %s stopped answering; requests failed, exiting", list(dead))
            time.sleep(grace_s)
            os._exit(1)
        time.sleep(0.5)


def exit_process(code: int) -> None:
    """End the process with ``code`` once our own cleanup is done.

    Interpreter finalization would then destroy the C++ side of the process group and the
    rank-0 TCPStore daemon in an unspecified order, which under load can abort the process
    ("terminate called without an active exception") after a clean shutdown. Everything
    this process owns is already flushed and closed, so it leaves without finalization.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
