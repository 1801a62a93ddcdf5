"""Helpers shared by the server tests: checkpoints, server processes, HTTP calls, oracles.

Checkpoints: random tiny Llamas written with transformers, each with a real `tokenizers`
tokenizer (byte-level BPE; SentencePiece-style byte-fallback + Metaspace) and a chat template.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
import openai
import tokenizers

from tests.checkpoints import write_llama
from tests.devices import rank_env, skip_without_gpus
from tests.tokenizer_fixtures import byte_fallback_tokenizer, byte_level_tokenizer, eos_id

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
MAX_MODEL_LEN = 256

CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def write_model(path: Path, kind: str) -> Path:
    """A random Llama whose vocabulary is the tokenizer's (321 or 431: TP4 does not divide)."""
    tok = byte_level_tokenizer(fresh=True) if kind == "byte_level" else byte_fallback_tokenizer(
        fresh=True
    )
    vocab = tok.get_vocab_size(with_added_tokens=True)
    write_llama(path, vocab_size=vocab)
    eos = eos_id(tok)
    config = json.loads((path / "config.json").read_text())
    bos = tok.token_to_id("<s>")
    config.update(eos_token_id=eos, bos_token_id=bos)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tok.save(str(path / "tokenizer.json"))
    special = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.id_to_token(eos),
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML if kind == "byte_level" else LLAMA2,
    }
    if bos is not None:
        special["bos_token"] = "<s>"
    (path / "tokenizer_config.json").write_text(json.dumps(special, indent=1))
    for name in ("generation_config.json",):
        (path / name).unlink(missing_ok=True)
    return path


def build_models(root: Path) -> dict[str, Path]:
    return {kind: write_model(root / kind, kind) for kind in ("byte_level", "byte_fallback")}


def free_port() -> int:
    """A port that was free a moment ago. Another process may take it before the caller
    binds it: servers started with it go through ``launch``, which retries on a clash."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORT_CLASH = ("address already in use", "errno 98")
"""What the server's log says when another process bound its port first."""
MAX_LAUNCHES = 4


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                out[int(pid)] = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(root: int) -> set[int]:
    """Every process below `root` (torchrun starts its workers in sessions of their own, so
    the process group of `root` does not hold them)."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def listening_pids(port: int) -> set[int] | None:
    """Processes listening on TCP `port` (None: /proc unreadable)."""
    inodes = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as lines:
                for line in list(lines)[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{fields[9]}]")
    except OSError:
        return None
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if inodes.intersection(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds):
                pids.add(int(pid))
        except OSError:
            continue
    return pids


@dataclass
class Server:
    name: str
    model_dir: Path
    port: int
    pid: int
    """Its process group too (started in a new session)."""
    log_path: Path
    proc: subprocess.Popen | None = None
    """Set in the process that started it (under xdist, another worker may have)."""
    tp: int = 1
    extra: tuple[str, ...] = ()
    home: Path | None = None
    """For servers shared between xdist workers: the folder of state.json and its lock."""
    launches: int = 1
    command: Callable[[int], list[str]] | None = None
    """argv after the interpreter, given the port (None: launch.serve, under torchrun)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=120.0, **kwargs)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def running(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else _alive(self.pid)

    def wait_healthy(self) -> None:
        """Until /health answers 200 from this server's own process group. A server whose
        port another process took first is started again on a fresh port."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.running() and not self._recover():
                raise RuntimeError(f"server {self.name} exited:\n{self.log_tail()}")
            try:
                healthy = httpx.get(self.url + "/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy and self.running():
                owners = listening_pids(self.port)
                if not owners or owners & ({self.pid} | descendants(self.pid)):  # unknown/ours
                    return
            time.sleep(0.25)
        raise RuntimeError(f"server {self.name} did not become healthy:\n{self.log_tail()}")

    def _clashed(self) -> bool:
        text = self.log_tail().lower()
        return any(sign in text for sign in PORT_CLASH) and self.launches < MAX_LAUNCHES

    def _recover(self) -> bool:
        """After the process ended: adopt the relaunch another xdist worker made, or relaunch
        it on a fresh port when its port was taken. True when there is a process to wait for."""
        if self.home is None:
            if not self._clashed():
                return False
            self._relaunch()
            return True
        with locked(self.home / "lock"):
            state_path = self.home / "state.json"
            state = json.loads(state_path.read_text())
            info = state["servers"].get(self.name)
            if info is not None and info["pid"] != self.pid:
                self._adopt(Server.from_state(self.name, info))
                return True
            if not self._clashed():
                return False
            self._relaunch()
            state["servers"][self.name] = self.state()
            state_path.write_text(json.dumps(state))
        return True

    def _relaunch(self) -> None:
        again = launch(self.name, self.model_dir, self.tp, list(self.extra),
                       self.log_path.parent, self.home, self.command)
        again.launches = self.launches + 1
        self._adopt(again)

    def _adopt(self, other: Server) -> None:
        self.port, self.pid, self.log_path = other.port, other.pid, other.log_path
        self.proc, self.launches = other.proc, other.launches

    def stop(self) -> None:
        """SIGTERM its process group (torchrun forwards it to every rank); after 20 s SIGKILL
        for the group and every process below it, so no rank outlives the test."""
        below = descendants(self.pid) if self.running() else set()
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            if not self.running():
                break
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            if sig == signal.SIGKILL:
                for pid in below | descendants(self.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + wait_s
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.wait(timeout=5)

    def state(self) -> dict:
        return {"model_dir": str(self.model_dir), "port": self.port, "pid": self.pid,
                "log_path": str(self.log_path), "tp": self.tp, "extra": list(self.extra),
                "home": None if self.home is None else str(self.home),
                "launches": self.launches}

    @classmethod
    def from_state(cls, name: str, state: dict) -> Server:
        home = state.get("home")
        return cls(name, Path(state["model_dir"]), state["port"], state["pid"],
                   Path(state["log_path"]), tp=state.get("tp", 1),
                   extra=tuple(state.get("extra", ())),
                   home=None if home is None else Path(home), launches=state.get("launches", 1))


SERVERS = {
    # fixture name: (model kind, tensor-parallel degree, extra serve arguments)
    # (test_concurrency keeps 64 requests in flight while other workers use the same server:
    # the default queue limit, 4 per slot, would shed theirs or its with a 429)
    "server": ("byte_level", 1, ["--capacity", "16", "--max-queued-requests", "256"]),
    "plain_server": ("byte_level", 1, ["--capacity", "4", "--no-logprobs"]),
    "scoring_server": ("byte_level", 1, ["--capacity", "8", "--prompt-logprobs"]),
    "tp4_server": ("byte_fallback", 4, ["--capacity", "4", "--prompt-logprobs"]),
}


def launch(name: str, model_dir: Path, tp: int, extra: list[str], log_dir: Path,
           home: Path | None = None, command: Callable[[int], list[str]] | None = None
           ) -> Server:
    """Start a server (launch.serve, under torchrun when tp > 1; or ``command(port)``) on the
    CPU with gloo, even on a GPU host (tests/devices.py); skips the calling test when its
    ranks cannot run here. Its port is picked here; ``wait_healthy`` starts it again on
    another port if some other process bound this one first."""
    skip_without_gpus(tp)
    port = free_port()
    serve = ["-m", "helios_logprobs.launch.serve", "--model", str(model_dir), "--host", "127.0.0.1",
             "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), *extra]
    if command is not None:
        cmd = [sys.executable, *command(port)]
    elif tp == 1:
        cmd = [sys.executable, *serve]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={tp}", *serve]
    env = dict(rank_env(tp), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Server(name, model_dir, port, proc.pid, log_path, proc, tp, tuple(extra), home,
                  command=command)


@contextlib.contextmanager
def locked(path: Path):
    with path.open("a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def strict_json(body: bytes | str):
    """json.loads that refuses NaN, Infinity and -Infinity."""

    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(body, parse_constant=refuse)


def post(server: Server, path: str, body: dict | str) -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(server.url + path, content=body, timeout=120.0,
                          headers={"content-type": "application/json"})
    return httpx.post(server.url + path, json=body, timeout=120.0)


def sse_events(response: httpx.Response) -> list:
    """Decoded `data:` events of an SSE body (strict JSON); the last must be [DONE]."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else strict_json(payload))
    assert events and events[-1] == "[DONE]"
    return events[:-1]


def response_events(response: httpx.Response) -> list:
    """Decoded events of a Responses API stream: `event: <type>` then `data: <json>` with that
    type in each block, and no [DONE] (OpenAI's framing, as vLLM sends it)."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        head, _, data = block.partition("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = strict_json(data[len("data: "):])
        assert event["type"] == head[len("event: "):], block
        events.append(event)
    assert events
    return events


# ----------------------------------------------------------------------------- oracles
TOLERANCE = 1e-4


def hf_rows(model_dir: Path, prompt_ids: list[int], generated: list[int]):
    """transformers' FP32 log_softmax rows that predict each generated token."""
    from tests.checkpoints import hf_logprobs

    rows = hf_logprobs(model_dir, list(prompt_ids) + list(generated))
    start = len(prompt_ids) - 1
    return rows[start : start + len(generated)]


def token_id_of(text: str) -> int:
    assert text.startswith("token_id:"), text
    return int(text[len("token_id:"):])


def _bytes_to_unicode() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def vocab_bytes(model_dir: Path) -> dict[int, bytes]:
    """Each id's true bytes, derived independently of runtime/text/token_bytes.py."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    spec = json.loads(tok.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    inverse = {c: b for b, c in _bytes_to_unicode().items()}
    out = {}
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        piece = tok.id_to_token(token_id)
        if byte_level:
            out[token_id] = (bytes(inverse[c] for c in piece) if all(c in inverse for c in piece)
                             else piece.encode())
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[token_id] = bytes([int(piece[3:5], 16)])
        else:
            out[token_id] = piece.replace("▁", " ").encode()
    return out


def byte_char_index(data: bytes) -> list[int]:
    """For every byte, the index of the character it ends up in after
    data.decode("utf-8", errors="replace") (maximal-subpart replacement)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    index, chars, pending = [], 0, []
    for position, byte in enumerate(data):
        out = decoder.decode(bytes([byte]))
        pending.append(position)
        if not out:
            continue
        held = len(decoder.getstate()[0])
        done, pending = pending[: len(pending) - held], pending[len(pending) - held:]
        if len(out) == 1:
            index += [chars] * len(done)
        else:
            assert len(out) == 2
            index += [chars] * (len(done) - 1) + [chars + 1]
        chars += len(out)
    tail = decoder.decode(b"", final=True)
    index += [chars] * len(pending)
    assert chars + len(tail) == len(data.decode("utf-8", errors="replace"))
    return index


def expected_offsets(pieces: list[bytes]) -> list[int]:
    """Character offset of each token's first byte in the decoded concatenation."""
    data = b"".join(pieces)
    index = byte_char_index(data)
    offsets, at = [], 0
    for piece in pieces:
        assert piece, "test tokens must have bytes"
        offsets.append(index[at])
        at += len(piece)
    return offsets


def served_name(server: Server) -> str:
    return server.client().models.list().data[0].id


def special_ids(model_dir: Path) -> set[int]:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    return {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}


BATCH_TOLERANCE = 1e-5


def same(a, b) -> bool:
    """Structural equality with floats equal within BATCH_TOLERANCE: the server batches
    concurrent requests together (tests run in parallel), and the forward pass is not
    batch-invariant in the last FP32 bits. Keys, their order, tokens and offsets are exact."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= (
            BATCH_TOLERANCE)
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, list | tuple):
        return (isinstance(b, list | tuple) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b, strict=True)))
    return a == b


# ----------------------------------------------------------------------------- tokenizers
@cache
def encoder(model_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@cache
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_prompt_ids(model_dir: Path, messages: list[dict], tools: list | None = None
                    ) -> list[int]:
    tok = hf_tokenizer(model_dir)
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def natural_from_dict(top: dict[str, float], chosen: int, n: int) -> list[tuple[int, float]]:
    """Completions dict: chosen first, then the natural top-n without repeating the chosen."""
    pairs = [(token_id_of(k), v) for k, v in top.items()]
    assert pairs[0][0] == chosen
    if len(pairs) == n + 1:
        return pairs[1:]
    assert len(pairs) == n
    rest, (_, value) = pairs[1:], pairs[0]
    at = next((i for i, (t, v) in enumerate(rest) if (value, -chosen) > (v, -t)), len(rest))
    return [*rest[:at], pairs[0], *rest[at:]]
