"""In-memory weight hand-off (publish.transport, components/transport/): what can run without a GPU.

The buckets hold exactly the published folder's tensors (names, shapes, dtype, values), the bucket
plan covers every tensor once within its size, the engine link's protocol (hello, refusals, the
version a finish carries), and the refusals before launch. tests/gpu/test_vllm_gpu.py runs the real
engine."""

from __future__ import annotations

import json
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from components.transport import link as link_mod
from components.transport import snapshot
from framework import api
from framework.errors import UserError
from framework.resolve.resolver import resolve
from framework.train import publish, published


def _writer(recipe: str, *extra):
    r = resolve(recipe, ["publish.interval=1", *extra], world_size=1, for_training=False)
    return r.ctx.components["model"].hf_writer(r.ctx.options["model"], r.ctx)


def _folder_tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


@pytest.mark.parametrize("recipe", ["debug_moe", "qwen35_debug_moe"])
def test_buckets_hold_the_published_folder(tmp_path, recipe):
    """Names (in order), shapes, dtype and values of the buckets equal the folder publication writes
    for the same weights at publish.dtype=bfloat16, with buckets small enough to split the model."""
    torch.manual_seed(0)
    model = api.build_model(recipe)
    writer = _writer(recipe)
    sd = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    tensors, hf_config = writer(sd)
    folder = published.write_version(tmp_path / "weights", 1, tensors, hf_config)
    want = _folder_tensors(folder)

    p = snapshot.plan(snapshot.meta_state([model]), writer.to_hf, torch.bfloat16, bucket_bytes=64 * 1024)
    assert len(p.buckets) > 2
    names = [e.name for e in p.entries()]
    assert len(names) == len(set(names)) and set(names) == set(want) == set(tensors)
    snap = snapshot.Snapshot(p, torch.device("cpu"), holder=True)
    assert snap.fill([model], writer.to_hf) == len(want)
    for name, t in want.items():
        got = snap.view(name)
        assert got.dtype == t.dtype == torch.bfloat16, name
        assert tuple(got.shape) == tuple(t.shape), name
        assert torch.equal(got, t), name
    # an engine rebuilds each bucket's tensors from names, shapes, sizes alone (vLLM's packed format)
    for i, b in enumerate(p.buckets):
        pieces = snap.buffers[i][: sum(b.sizes)].split(b.sizes)
        for name, shape, piece in zip(b.names, b.shapes, pieces):
            assert torch.equal(piece.view(p.dtype).view(shape), want[name]), name


def test_a_later_fill_follows_the_model():
    model = api.build_model("debug_moe")
    writer = _writer("debug_moe")
    p = snapshot.plan(snapshot.meta_state([model]), writer.to_hf, torch.float32, bucket_bytes=2**20)
    snap = snapshot.Snapshot(p, torch.device("cpu"), holder=True)
    snap.fill([model], writer.to_hf)
    before = snap.view("lm_head.weight").clone()
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(1.0)
    snap.fill([model], writer.to_hf)
    assert torch.equal(snap.view("lm_head.weight"), before + 1.0)


def test_bucket_plan_covers_every_tensor_once_within_its_size():
    meta = {"tok_embeddings.weight": torch.empty(100, 8, device="meta"),
            **{f"layers.{i}.w{j}": torch.empty(10, 10 * (j + 1), device="meta") for i in range(3) for j in range(3)},
            "norm.weight": torch.empty(8, device="meta"), "output.weight": torch.empty(100, 8, device="meta")}
    p = snapshot.plan(meta, lambda g: dict(g), torch.bfloat16, bucket_bytes=1000)
    names = [e.name for e in p.entries()]
    assert names == list(meta)  # layer by layer, in order, each once
    for b in p.buckets:
        assert b.nbytes == sum(b.sizes)
        assert [e.offset for e in b.entries] == [sum(b.sizes[:i]) for i in range(len(b.entries))]
        assert b.nbytes <= 1000 or len(b.entries) == 1  # a tensor larger than a bucket travels alone
    big = [b for b in p.buckets if b.nbytes > 1000]
    assert [b.names for b in big] == [["tok_embeddings.weight"], ["output.weight"]]
    assert p.nbytes == sum(t.numel() * 2 for t in meta.values())
    with pytest.raises(ValueError, match="bucket_bytes"):
        snapshot.plan(meta, dict, torch.bfloat16, bucket_bytes=0)


def test_layer_groups_keep_each_layer_whole_and_the_rest_around_them():
    keys = ["tok_embeddings.weight", "layers.0.a", "layers.0.b", "layers.1.a", "layers.10.a", "norm.weight",
            "output.weight"]
    assert snapshot.layer_groups(keys) == [["tok_embeddings.weight"], ["layers.0.a", "layers.0.b"], ["layers.1.a"],
                                           ["layers.10.a"], ["norm.weight", "output.weight"]]


# -- the engine link ---------------------------------------------------------------------------------

HF = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 320}


class FakeEngine(threading.Thread):
    """A generator's side of the link: connects with the file's key, says hello, records requests."""

    def __init__(self, directory: Path, hf_config: dict, key: bytes | None = None, fail: str | None = None,
                 finish_s: float = 0.0):
        super().__init__(daemon=True)
        self.finish_s = finish_s  # how long a finish_weight_update takes (a slow engine)
        self.info = json.loads((directory / link_mod.LINK_FILE).read_text())
        self.hf_config, self.key, self.fail = hf_config, key, fail
        self.calls: list = []
        self.answer = None

    def run(self):
        key = self.key or bytes.fromhex(self.info["authkey"])
        try:
            conn = Client((self.info["host"], self.info["port"]), authkey=key)
        except Exception as e:  # noqa: BLE001 - the trainer refused the key
            self.answer = e
            return
        conn.send({"hello": 1, "gpu_uuids": ["GPU-x"], "world_size": 1, "hf_config": self.hf_config})
        self.answer = conn.recv()
        if "error" in self.answer:
            return
        while True:
            method, arg = conn.recv()
            self.calls.append((method, arg))
            if method == "close":
                return
            if method == "finish_weight_update":
                time.sleep(self.finish_s)
            conn.send(("error", "boom") if method == self.fail else ("ok", 0.25))


def test_link_drives_the_protocol_and_reports_the_engine_time(tmp_path):
    link = link_mod.EngineLink(tmp_path, "127.0.0.1:0", HF, transport="vllm_ipc")
    assert oct((tmp_path / link_mod.LINK_FILE).stat().st_mode & 0o777) == "0o600"  # the key is the user's
    eng = FakeEngine(tmp_path, {**HF, "model_type": "qwen3_moe"})
    eng.start()
    hello = link.accept(timeout=10)
    assert hello["world_size"] == 1
    link.init_weight_transfer_engine({"packed": True})
    link.start_weight_update()
    link.update_weights({"names": ["a"]})
    link.finish_weight_update("7")
    assert link.take_engine_s() == pytest.approx(1.0)
    link.close()
    eng.join(5)
    assert eng.answer == {"ok": True}
    assert [m for m, _ in eng.calls] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                         "finish_weight_update", "close"]
    assert eng.calls[3][1] == "7"  # the version the engine's records then carry
    assert not (tmp_path / link_mod.LINK_FILE).exists()


def test_an_engine_serving_another_model_is_refused_at_hello(tmp_path):
    link = link_mod.EngineLink(tmp_path, "127.0.0.1:0", HF, transport="vllm_nccl")
    eng = FakeEngine(tmp_path, {**HF, "hidden_size": 128, "num_hidden_layers": 4})
    eng.start()
    with pytest.raises(link_mod.EngineError, match=r"hidden_size: trainer 64 != engine 128.*num_hidden_layers"):
        link.accept(timeout=10)
    eng.join(5)
    assert "error" in eng.answer
    link.close()


def test_no_engine_and_a_wrong_key_are_errors_that_name_the_link_file(tmp_path):
    link = link_mod.EngineLink(tmp_path, "127.0.0.1:0", HF, transport="vllm_ipc")
    with pytest.raises(link_mod.EngineError, match=r"no engine connected .* within 0 s .*engine_link.json"):
        link.accept(timeout=0.2)
    eng = FakeEngine(tmp_path, HF, key=b"not the key")
    eng.start()
    with pytest.raises(link_mod.EngineError, match="without the key"):
        link.accept(timeout=10)
    eng.join(5)
    link.close()


def test_an_engine_error_names_the_request(tmp_path):
    link = link_mod.EngineLink(tmp_path, "127.0.0.1:0", HF, transport="vllm_ipc")
    eng = FakeEngine(tmp_path, HF, fail="update_weights")
    eng.start()
    link.accept(timeout=10)
    link.start_weight_update()
    with pytest.raises(link_mod.EngineError, match="the engine failed update_weights: boom"):
        link.update_weights({})
    link.close()


def test_config_differences_ignore_the_text_suffix_and_keys_one_side_lacks():
    assert link_mod.config_differences({"model_type": "qwen3_5_moe_text", "hidden_size": 8},
                                       {"model_type": "qwen3_5_moe", "text_config": {"hidden_size": 8}}) == []
    assert link_mod.config_differences({"vocab_size": 320}, {"vocab_size": 2048}) == [
        "vocab_size: trainer 320 != engine 2048"]


# -- refusals before launch --------------------------------------------------------------------------

def _vllm_installed() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_vllm_installed(), reason="checks the refusal without vLLM")
def test_an_in_memory_transport_without_vllm_is_refused_before_launch():
    with pytest.raises(UserError) as e:
        resolve("debug_grpo_live", ["publish.transport=vllm_ipc"], world_size=1, for_training=True)
    msg = str(e.value)
    assert "publish.transport=vllm_ipc" in msg and "pip install -e '.[vllm]'" in msg


@pytest.mark.parametrize("override, match", [
    ("publish.engine=nohost", "not HOST:PORT"),
    ("publish.bucket_mb=0", "MiB per transfer bucket"),
    ("publish.engine_timeout=-1", "must be a finite number > 0"),
    ("publish.transport=vllm_tcp", "vllm_tcp"),
])
def test_bad_transport_settings_are_refused(override, match):
    with pytest.raises(UserError, match=match):
        resolve("debug_grpo_live", ["publish.transport=vllm_ipc", override], world_size=1, for_training=False)


def test_engine_settings_with_files_are_refused_as_without_effect():
    with pytest.raises(UserError, match="publish.engine"):
        resolve("debug_grpo_live", ["publish.engine=127.0.0.1:5000"], world_size=1, for_training=False)


def _ipc_publisher(tmp_path, background: str):
    """A publisher of debug_moe with vllm_ipc into ``tmp_path/w`` and a fake generator thread that, like
    vllm_generator.py, loads the first folder, then connects through the link file (``started["eng"]``)."""
    from types import SimpleNamespace

    from components.transport.vllm import VllmIPC

    model = api.build_model("debug_moe")
    writer = _writer("debug_moe")
    r = resolve("debug_grpo_live", ["publish.transport=vllm_ipc", "publish.bucket_mb=1", "publish.dtype=bfloat16",
                                    f"publish.dir={tmp_path / 'w'}"], world_size=1, for_training=False)
    s = publish.PublishSettings(interval=1, dir=str(tmp_path / "w"), keep=3, background=background, convert=writer,
                                dtype="bfloat16", transport=VllmIPC, transport_options=r.ctx.options["transport"])
    started = {}

    def engine():
        link_mod.wait_for(lambda: (tmp_path / "w" / link_mod.LINK_FILE).is_file(), 30)
        started["folder"] = (tmp_path / "w" / "step-0" / "model.safetensors").is_file()
        started["eng"] = FakeEngine(tmp_path / "w", writer.hf_config)
        started["eng"].run()

    threading.Thread(target=engine, daemon=True).start()
    return publish.Publisher(s), SimpleNamespace(model_parts=[model]), started, writer


def test_publisher_hands_every_version_after_the_first_to_the_engine(tmp_path):
    """The run's first version is a folder the engine starts from; the trainer then waits for the
    engine's hello before its first step (vLLM sizes its cache from the GPU memory it sees while it
    starts), and each later version arrives as start / one update per bucket / finish(version) with the
    published folder's names."""
    pub, trainer, started, writer = _ipc_publisher(tmp_path, "auto")
    pub.publish(trainer, 0, initial=True)  # returns once the engine is up: the first step waits for it
    assert started["folder"] and pub._sender.link.connected
    eng = started["eng"]
    assert link_mod.wait_for(lambda: eng.answer is not None, 10), "the engine's hello went unanswered"
    assert eng.answer == {"ok": True}
    folder = set(_folder_tensors(tmp_path / "w" / "step-0"))
    for v in (1, 2):
        pub.publish(trainer, v)
    buckets = len(pub._sender.plan.buckets)
    pub.close()
    link_mod.wait_for(lambda: eng.calls and eng.calls[-1][0] == "close", 10)
    methods = [m for m, _ in eng.calls]
    assert methods[0] == "init_weight_transfer_engine" and methods[-1] == "close"
    assert [a for m, a in eng.calls if m == "finish_weight_update"] == ["1", "2"]
    first = methods.index("finish_weight_update")
    sent = [n for m, a in eng.calls[:first] if m == "update_weights" for n in a["names"]]
    assert len(sent) == len(set(sent)) and set(sent) == folder  # every tensor of the folder, once
    assert methods.count("update_weights") == 2 * buckets and methods.count("start_weight_update") == 2
    assert not (tmp_path / "w" / "step-1").exists()  # in memory: no folder for the later versions


@pytest.mark.parametrize("when_busy, finished", [("wait", ["1", "2", "3", "4"]), ("skip", ["1", "4"])])
def test_a_version_due_mid_transfer_waits_or_is_deferred_to_the_next_free_moment(tmp_path, when_busy, finished):
    """publish.when_busy: with an engine slower than the steps, `wait` hands over every version (each
    publication waiting for the last transfer), `skip` defers a version due while one is landing and
    hands over the newest once the engine is free: at the flush before the trainer waits for rollouts
    (or ends), without waiting at the steps in between."""
    from types import SimpleNamespace

    from components.transport.vllm import VllmIPC

    model = api.build_model("debug_moe")
    writer = _writer("debug_moe")
    r = resolve("debug_grpo_live", ["publish.transport=vllm_ipc", f"publish.when_busy={when_busy}",
                                    f"publish.dir={tmp_path / 'w'}"], world_size=1, for_training=False)
    s = publish.PublishSettings(interval=1, dir=str(tmp_path / "w"), keep=3, background="true", convert=writer,
                                transport=VllmIPC, transport_options=r.ctx.options["transport"], log=publish.PublishLog())
    trainer = SimpleNamespace(model_parts=[model])
    pub = publish.Publisher(s)
    started = {}

    def engine():
        link_mod.wait_for(lambda: (tmp_path / "w" / link_mod.LINK_FILE).is_file(), 30)
        started["eng"] = FakeEngine(tmp_path / "w", writer.hf_config, finish_s=1.0)
        started["eng"].run()

    threading.Thread(target=engine, daemon=True).start()
    pub.publish(trainer, 0, initial=True)
    t0 = time.perf_counter()
    for v in (1, 2, 3, 4):  # steps far shorter than the engine's 1 s per version
        pub.publish(trainer, v)
    at_steps = time.perf_counter() - t0
    deferred = s.log.take().get("deferred")
    pub.flush(trainer)  # before the trainer waits for rollouts, or at its end
    pub.close()
    eng = started["eng"]
    link_mod.wait_for(lambda: eng.calls and eng.calls[-1][0] == "close", 10)
    assert [a for m, a in eng.calls if m == "finish_weight_update"] == finished
    if when_busy == "skip":
        assert at_steps < 0.5 and deferred == 4  # no step waited for the engine; the newest version went later
    else:
        assert at_steps > 2.5 and deferred is None  # versions 2, 3 and 4 each waited for the one before


def test_when_busy_with_files_is_refused_as_without_effect():
    with pytest.raises(UserError, match="publish.when_busy"):
        resolve("debug_grpo_live", ["publish.when_busy=skip"], world_size=1, for_training=False)


def test_no_engine_within_the_timeout_stops_the_run_before_its_first_step(tmp_path):
    """An in-memory transport whose engine never connects: the initial publication (before step 1)
    raises the refusal naming what to start, after publish.engine_timeout, with the first folder kept."""
    from types import SimpleNamespace

    from components.transport.vllm import VllmIPC

    r = resolve("debug_grpo_live", ["publish.transport=vllm_ipc", "publish.engine_timeout=1",
                                    f"publish.dir={tmp_path / 'w'}"], world_size=1, for_training=False)
    s = publish.PublishSettings(interval=1, dir=str(tmp_path / "w"), keep=3, background="false", convert=_writer("debug_moe"),
                                transport=VllmIPC, transport_options=r.ctx.options["transport"])
    pub = publish.Publisher(s)
    with pytest.raises(UserError, match="Start the generator"):
        pub.publish(SimpleNamespace(model_parts=[api.build_model("debug_moe")]), 0, initial=True)
    assert (tmp_path / "w" / "step-0" / "model.safetensors").is_file()


def test_the_plan_counts_the_hand_offs_buffers_on_rank_0():
    """The preflight sees the buckets (the model once in the wire dtype) and NCCL's two send buffers;
    folders add nothing on the GPU."""
    from framework.plan.planner import plan

    def terms(*over):
        r = resolve("debug_grpo_vllm", list(over), world_size=1, for_training=False)
        return {t.name: t.bytes for t in plan(r).terms}, r.facts.n_params

    folder, n = terms("publish.transport=hf_folder")
    ipc, _ = terms()
    nccl, _ = terms("publish.transport=vllm_nccl", "publish.bucket_mb=1")
    assert "transfer_buckets" not in folder
    assert ipc["transfer_buckets"] == n * 2  # publish.dtype=bfloat16
    assert nccl["transfer_send_buffers"] == 2 * min(n * 2, 2**20)


def test_a_busy_engine_port_is_refused_before_launch(monkeypatch):
    import socket

    from components.transport import vllm as vllm_transport

    monkeypatch.setattr(vllm_transport, "_vllm_or_refuse", lambda name: None)  # past the port check only
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=rf"publish.engine=127.0.0.1:{port}: rank 0 cannot listen there"):
            resolve("debug_grpo_vllm", [f"publish.engine=127.0.0.1:{port}"], world_size=1, for_training=True)


def test_an_ipc_engine_on_another_gpu_is_refused_before_any_transfer():
    from components.transport.sender import same_gpu_or_refuse

    same_gpu_or_refuse("ipc", "GPU-a", {"gpu_uuids": ["GPU-a"]})
    same_gpu_or_refuse("nccl", "GPU-a", {"gpu_uuids": ["GPU-b"]})  # NCCL: other GPUs are the point
    with pytest.raises(UserError, match=r"not on the trainer's rank-0 GPU GPU-a.*publish.transport=vllm_nccl"):
        same_gpu_or_refuse("ipc", "GPU-a", {"gpu_uuids": ["GPU-b"]})


def test_a_stacked_weights_slices_go_in_one_copy_and_nothing_else_merges():
    """coalesce: consecutive slices of one tensor into back-to-back places merge into one flat copy; a
    gap, another storage or a transposed view on either side keeps its own; the copies land the same."""
    src = torch.randn(6, 4, 3)
    other = torch.randn(2, 4, 3)
    buf = torch.zeros(12 * 12)
    dsts = [buf[i * 12:(i + 1) * 12].view(4, 3) for i in range(12)]
    pairs = [(dsts[0], src[0]), (dsts[1], src[1]), (dsts[2], src[2]),  # one run of three
             (dsts[3], src[4]),  # a gap in the source
             (dsts[4], src[5]),  # continues src[4]: a run of two with the one above
             (dsts[5], other[0]),  # another storage
             (dsts[7], other[1]),  # a gap in the destination
             (dsts[8], src[0].t().t().contiguous()),  # a copy: another storage
             (dsts[9], torch.randn(3, 4).t())]  # not contiguous
    merged = snapshot.coalesce(pairs)
    assert [d.numel() for d, _ in merged] == [36, 24, 12, 12, 12, 12]
    for d, s in merged:
        d.copy_(s)
    for d, s in pairs:
        assert torch.equal(d, s)


def test_a_fill_copies_each_stacked_expert_weight_once():
    """qwen3_5's experts are one tensor each in the published names but one stacked weight in the model:
    the fill copies the stacked weight in one go (fewer copies than tensors) and the values stay those of
    the published folder (test_buckets_hold_the_published_folder)."""
    model = api.build_model("qwen35_debug_moe")
    writer = _writer("qwen35_debug_moe")
    p = snapshot.plan(snapshot.meta_state([model]), writer.to_hf, torch.bfloat16, bucket_bytes=2**30)
    snap = snapshot.Snapshot(p, torch.device("cpu"), holder=True)
    n = snap.fill([model], writer.to_hf)
    experts = sum(".mlp.experts." in e.name for e in p.entries())
    assert experts > 0 and snap.copies <= n - experts + 3 * len(model.layers), (snap.copies, n, experts)


def test_the_engine_is_told_only_after_the_snapshots_copies_have_landed(tmp_path, monkeypatch):
    """The training thread queues the snapshot's copies and goes on (no host synchronize); the sender thread
    waits on the event behind them before it hands the engine anything. Here a fake event that lands late:
    without the wait, the engine's first request would come before it."""
    from components.transport import sender as sender_mod

    order = []

    class LateEvent:
        def synchronize(self):
            time.sleep(0.3)
            order.append("copies landed")

    pub, trainer, _, _ = _ipc_publisher(tmp_path, "true")
    pub.publish(trainer, 0, initial=True)
    monkeypatch.setattr(sender_mod.InMemorySender, "_mark_landed", lambda self: LateEvent())
    real = sender_mod.InMemorySender._send_ipc
    monkeypatch.setattr(sender_mod.InMemorySender, "_send_ipc",
                        lambda self, v: (order.append("engine told"), real(self, v))[1])
    pub.publish(trainer, 1)
    pub.close()
    assert order == ["copies landed", "engine told"], order
