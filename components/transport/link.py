"""The control channel between the trainer and an inference engine's process (docs/rl.md).

The trainer's rank 0 listens on ``publish.engine`` (``HOST:PORT``; port 0 picks a free one) and
writes where, with a key, to ``PUBLISH_DIR/engine_link.json`` (mode 0600) next to the published
folders. The generator, once it has loaded the first published folder, connects
(``multiprocessing.connection.Client(address, authkey=bytes.fromhex(key))``) and sends a hello:

    {"hello": 1, "gpu_uuids": [...], "world_size": N, "hf_config": {...}}

(``gpu_uuids``: the engine's GPUs, ``world_size``: its workers, ``hf_config``: the config.json the
engine loaded). The trainer answers ``{"ok": true}`` or ``{"error": "..."}`` (a model whose config
differs from the trainer's, an IPC engine on another GPU) and from then on sends requests, each a
``(method, argument)`` pair, which the generator answers with ``("ok", seconds)`` or
``("error", message)``: vLLM's four weight-sync calls, ``init_weight_transfer_engine(init_info)``,
``start_weight_update(None)``, ``update_weights(update_info)`` and
``finish_weight_update(version)``, then ``("close", None)`` at the end of the run. Between
``start_weight_update`` and ``finish_weight_update`` the generator does nothing else: that is the
time the engine is paused, and the sum of the replies' seconds.

``EngineLink`` is the trainer's side, and an object with vLLM's four-method weight-sync client
surface (``vllm.distributed.weight_transfer.base.VLLMWeightSyncClient``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

LINK_FILE = "engine_link.json"
# config.json keys the trainer and the engine must agree on (a different model is refused at hello)
MODEL_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "intermediate_size", "tie_word_embeddings")


class EngineError(RuntimeError):
    """The engine refused or failed a request, or could not be reached; the message says which."""


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (for example 127.0.0.1:0, port 0 picks a free one)")
    return host, int(port)


def _text_config(cfg: dict) -> dict:
    """The text model's keys of a config.json (a multimodal config nests them in text_config)."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def config_differences(trainer: dict, engine: dict) -> list[str]:
    """``key: trainer value != engine value`` for each model key both configs hold and disagree on."""
    t, e = _text_config(trainer), _text_config(engine)
    out = []
    for k in MODEL_KEYS:
        if k in t and k in e and t[k] != e[k]:
            if k == "model_type" and str(e[k]).removesuffix("_text") == str(t[k]).removesuffix("_text"):
                continue
            out.append(f"{k}: trainer {t[k]!r} != engine {e[k]!r}")
    return out


class EngineLink:
    """The trainer's end of the channel (rank 0 only)."""

    def __init__(self, directory, address: str, hf_config: dict, *, transport: str):
        host, port = parse_address(address)
        self.key = secrets.token_bytes(32)
        try:
            self._sock = socket.create_server((host, port))
        except OSError as e:
            raise EngineError(f"cannot listen on {address} for the engine: {e}") from None
        self.address = self._sock.getsockname()[:2]
        self.hf_config = hf_config
        self.transport = transport
        self.path = Path(directory) / LINK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{LINK_FILE}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"host": self.address[0], "port": self.address[1], "authkey": self.key.hex(),
                       "transport": transport, "protocol": 1}, f)
        os.replace(tmp, self.path)
        self._conn = None
        self.hello: dict = {}
        self._accepting: threading.Thread | None = None
        self._accept_error: EngineError | None = None
        self._lock = threading.Lock()
        self.engine_s = 0.0  # seconds the engine reported for the requests since the last take_engine_s

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def start_accepting(self, timeout: float) -> None:
        """Accept the engine in a background thread (``accept``), so that a generator which connects
        before the trainer's first in-memory version (it loads the first folder, then connects, then
        samples the rollouts the trainer is waiting for) is answered at once."""
        self._accept_error = None

        def run():
            try:
                self.accept(timeout)
            except EngineError as e:
                self._accept_error = e

        self._accepting = threading.Thread(target=run, name="apiary-engine-link", daemon=True)
        self._accepting.start()

    def wait_connected(self) -> dict:
        """The engine's hello once ``start_accepting``'s thread has it; its EngineError otherwise."""
        t = self._accepting
        if t is not None:
            t.join()
            self._accepting = None
        if self._accept_error is not None:
            e, self._accept_error = self._accept_error, None
            raise e
        if self._conn is None:
            raise EngineError("no engine is connected")
        return self.hello

    def accept(self, timeout: float) -> dict:
        """Wait up to ``timeout`` seconds for the generator to connect; returns its hello."""
        self._sock.settimeout(timeout)
        try:
            s, _ = self._sock.accept()
        except (socket.timeout, TimeoutError):
            raise EngineError(f"no engine connected to {self.address[0]}:{self.address[1]} within {timeout:.0f} s "
                              f"(the generator reads {self.path})") from None
        s.setblocking(True)
        conn = Connection(s.detach())
        try:  # both sides prove they hold the key (what multiprocessing's Listener.accept does)
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
        except Exception as e:  # noqa: BLE001 - a wrong key or a stranger: refuse it, keep listening
            conn.close()
            raise EngineError(f"a process connected without the key of {self.path} ({type(e).__name__})") from None
        if not conn.poll(timeout):
            conn.close()
            raise EngineError("the engine connected but sent no hello")
        hello = conn.recv()
        if not isinstance(hello, dict) or hello.get("hello") != 1:
            conn.close()
            raise EngineError(f"the engine's first message is not a hello: {str(hello)[:200]}")
        diff = config_differences(self.hf_config, hello.get("hf_config") or {})
        if diff:
            msg = ("the engine serves another model than the trainer trains (" + "; ".join(diff) + ")")
            conn.send({"error": msg})
            conn.close()
            raise EngineError(msg)
        conn.send({"ok": True})
        self._conn, self.hello = conn, hello
        return hello

    def _call(self, method: str, arg=None):
        if self._conn is None:
            raise EngineError("no engine is connected")
        with self._lock:
            try:
                self._conn.send((method, arg))
                status, value = self._conn.recv()
            except (EOFError, OSError, ConnectionError) as e:
                self._conn = None
                raise EngineError(f"the engine went away during {method} ({type(e).__name__}: {e})") from None
        if status != "ok":
            raise EngineError(f"the engine failed {method}: {value}")
        if isinstance(value, (int, float)):
            self.engine_s += float(value)
        return value

    def probe(self, prompts: list[list[int]], tokens: int) -> dict:
        """The engine's greedy continuations of ``prompts`` and their log-probs (tests, benchmarks)."""
        return self._call("probe", {"prompts": prompts, "tokens": tokens})

    # vLLM's weight-sync client surface
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def take_engine_s(self) -> float:
        with self._lock:
            s, self.engine_s = self.engine_s, 0.0
        return s

    def close(self) -> None:
        if self._conn is not None:
            try:
                with self._lock:
                    self._conn.send(("close", None))
            except (OSError, EOFError):
                pass
            self._conn.close()
            self._conn = None
        self._sock.close()
        if self._accepting is not None:  # an accept still waiting ends with the closed socket
            self._accepting.join(timeout=5)
            self._accepting = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def wait_for(predicate, timeout: float, every: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return predicate()
