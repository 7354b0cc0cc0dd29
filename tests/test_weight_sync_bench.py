"""benchmarks/weight_sync_bench.py builds the trainer's in-memory sender the way the trainer does: its
sender is made from the trainer's own PublishSettings, so a field the sender reads cannot be missing
from the bench (a GPU sitting lost tests/gpu/test_vllm_gpu.py to exactly that). On the CPU the sender
is built as far as waiting for an engine, which none starts here: it must stop with the trainer's
refusal, not an AttributeError."""

import sys
from pathlib import Path

import pytest

from framework.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sender_is_built_like_the_trainers(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import weight_sync_bench as w

    from framework import api
    from framework.resolve.resolver import resolve

    r = resolve("debug_grpo_vllm", ["publish.interval=1"], world_size=1, for_training=False)
    writer = r.ctx.components["model"].hf_writer(r.ctx.options["model"], r.ctx)
    model = api.build_model("debug_grpo_vllm", device="cpu")
    with pytest.raises(UserError, match="Start the generator"):
        w.sender(model, writer, tmp_path / "weights", "ipc", bucket_mb=1, timeout=0.5)



def test_the_bench_starts_its_engine_before_the_sender_that_waits_for_it(tmp_path, monkeypatch):
    """The sender waits for the engine's hello as it is made; an engine started only after it (the order
    that failed both IPC cases of tests/gpu/test_vllm_gpu.py on an H200: "no engine connected within
    300 s") never comes. ``linked`` starts the engine first; here a fake one that, like the generator,
    waits for the link file and says hello."""
    import threading

    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    import weight_sync_bench as w
    from test_transport import FakeEngine

    from components.transport import link as link_mod
    from framework import api
    from framework.resolve.resolver import resolve

    r = resolve("debug_grpo_vllm", ["publish.interval=1"], world_size=1, for_training=False)
    writer = r.ctx.components["model"].hf_writer(r.ctx.options["model"], r.ctx)
    model = api.build_model("debug_grpo_vllm", device="cpu")
    engines = []

    class Proc:
        def kill(self):
            pass

    def start_engine(weights, backend, gpu, memory, log):  # the generator: waits for the link file, says hello
        def serve():
            link_mod.wait_for(lambda: (weights / link_mod.LINK_FILE).is_file(), 20)
            engines.append(FakeEngine(weights, writer.hf_config))
            engines[-1].run()
        threading.Thread(target=serve, daemon=True).start()
        return Proc()

    monkeypatch.setattr(w, "start_engine", start_engine)
    s, _ = w.linked(model, writer, tmp_path / "weights", "ipc", 0.1, tmp_path / "engine.log", bucket_mb=1, timeout=10)
    try:
        assert s.link.connected and engines  # the sender came back linked to the engine started first
        assert link_mod.wait_for(lambda: engines[0].answer is not None, 10) and engines[0].answer == {"ok": True}
    finally:
        s.close()
