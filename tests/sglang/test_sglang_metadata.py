"""The SGLang plugin without SGLang: metadata-only layouts (``refit plan``), the ticket, the HTTP client.

The live-vs-metadata agreement is checked against SGLang's real model classes in
``test_sglang_refit.py``. The HTTP client is checked against a loopback stand-in that records what
an SGLang server would receive (no SGLang server can run here); where SGLang is installed, the
payload is decoded with SGLang's own ``MultiprocessingSerializer``.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from refit_sglang.client import HttpClient, PauseMode
from refit_sglang.layout import destination_layout
from refit_sglang.ticket import LOAD_FORMAT, RefitTicket

from refit_core import Box, ParallelLayout, PluginError, RefitError, get_plugin_manager
from refit_core.kit.models import PRESETS, checkpoint_specs


def _boxes(config: dict, layout: ParallelLayout, rank: int, name: str) -> list[Box]:
    return [p.box for p in destination_layout(config, layout, rank).pieces if p.spec.name == name]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("layout", ["tp=1", "tp=2", "tp=4", "tp=2,ep=2", "tp=4,ep=2", "tp=2,dp=2"])
def test_every_element_lands_exactly_once_per_engine(preset: str, layout: str) -> None:
    """Each engine replica covers every checkpoint element; replicated KV heads and norms count once
    per TP rank that holds them, everything else exactly once."""
    config = dict(PRESETS[preset])
    lay = ParallelLayout.parse(layout)
    specs = {s.name: s for s in checkpoint_specs(config)}
    for dp_i in range(lay.dp):
        counts = {name: torch.zeros(spec.shape, dtype=torch.int32) for name, spec in specs.items()}
        for tp_i in range(lay.tp):
            for piece in destination_layout(config, lay, dp_i * lay.tp + tp_i).pieces:
                assert piece.view is None
                piece.box.slice_of(counts[piece.spec.name]).add_(1)
        for name, count in counts.items():
            assert count.min() >= 1, f"{name}: elements no rank of engine {dp_i} receives"
            sharded = any(leaf in name for leaf in ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                                    "w1", "w2", "w3", "embed_tokens", "lm_head"))
            if sharded and not name.endswith("gate.weight"):
                assert count.max() == 1, f"{name}: elements received twice in engine {dp_i}"


def test_kv_heads_replicate_and_vocab_pads_like_sglang() -> None:
    config = dict(PRESETS["tiny-llama"], vocab_size=500)  # 2 KV heads of 32; vocab padded to 512
    lay = ParallelLayout(tp=4)
    k = [_boxes(config, lay, r, "model.layers.0.self_attn.k_proj.weight")[0] for r in range(4)]
    assert [(b.offsets[0], b.sizes[0]) for b in k] == [(0, 32), (0, 32), (32, 32), (32, 32)]
    emb = [_boxes(config, lay, r, "model.embed_tokens.weight") for r in range(4)]
    assert emb == [[Box((0, 0), (128, 128))], [Box((128, 0), (128, 128))], [Box((256, 0), (128, 128))],
                   [Box((384, 0), (116, 128))]]


def test_expert_parallel_blocks_with_expert_tensor_parallel_inside() -> None:
    """tp=4, ep=2: TP rank r holds experts of block r // 2, their rows split over r % 2."""
    config = dict(PRESETS["tiny-qwen3-moe"])  # 8 experts, moe_intermediate 64, hidden 128
    lay = ParallelLayout(tp=4, ep=2)
    gate = "model.layers.0.mlp.experts.gate_proj.weight"
    down = "model.layers.0.mlp.experts.down_proj.weight"
    assert [_boxes(config, lay, r, gate)[0] for r in range(4)] == [
        Box((0, 0, 0), (4, 32, 128)), Box((0, 32, 0), (4, 32, 128)),
        Box((4, 0, 0), (4, 32, 128)), Box((4, 32, 0), (4, 32, 128))]
    assert _boxes(config, lay, 3, down) == [Box((4, 0, 32), (4, 128, 32))]


@pytest.mark.parametrize("layout,error", [("pp=2", "sglang layouts take tp, ep and dp"),
                                          ("tp=2,ep=4", "must divide"), ("tp=3", "cannot split")])
def test_layouts_sglang_cannot_build_are_refused_by_name(layout: str, error: str) -> None:
    with pytest.raises(PluginError, match=error):
        destination_layout(dict(PRESETS["tiny-llama"]), ParallelLayout.parse(layout), 0)


def test_refit_plan_reaches_the_sglang_layout_through_the_hook() -> None:
    pm = get_plugin_manager()
    mapping = pm.hook.refit_destination_layout(backend="sglang", config=dict(PRESETS["tiny-qwen3"]),
                                                layout=ParallelLayout(tp=2), rank=1)
    assert mapping is not None and mapping.pieces and all(p.view is None for p in mapping.pieces)
    assert pm.hook.refit_destination_map(model=torch.nn.Linear(2, 2)) is None  # not an SGLang model


# -- the ticket ---------------------------------------------------------------------------------

def test_ticket_round_trips_through_its_payload() -> None:
    ticket = RefitTicket("10.0.0.1:29600", world_size=4, version=7, rank_offset=2, timeout_s=30.0)
    (name, tensor), = ticket.named_tensors()
    assert tensor.numel() == 0
    assert RefitTicket.parse([(name, tensor)]) == ticket
    assert ticket.at(8).version == 8 and ticket.at(8).session == ticket.session


@pytest.mark.parametrize("payload,error", [
    ([], "exactly one"),
    ([("model.layers.0.mlp.down_proj.weight", torch.zeros(1))], "not a refit ticket"),
    ([("refit.ticket:{not json", torch.zeros(0))], "not valid JSON"),
    ([("refit.ticket:" + json.dumps({"rendezvous": "h:1", "world_size": 2}), torch.zeros(0))], "version"),
    ([("refit.ticket:" + json.dumps({"rendezvous": "h:1", "world_size": 2, "version": "3"}), torch.zeros(0))],
     "version"),
    ([("refit.ticket:" + json.dumps({"rendezvous": "h:1", "world_size": 2, "version": 3, "extra": 1}),
       torch.zeros(0))], "extra"),
    ([("refit.ticket:" + json.dumps({"rendezvous": "nohost", "world_size": 2, "version": 3}), torch.zeros(0))],
     "rendezvous"),
    ([("refit.ticket:" + json.dumps({"rendezvous": "h:1", "world_size": 2, "version": 3, "rank_offset": 2}),
       torch.zeros(0))], "rank_offset"),
])
def test_bad_tickets_fail_naming_what_is_wrong(payload: list, error: str) -> None:
    with pytest.raises(RefitError, match=error):
        RefitTicket.parse(payload)


# -- the HTTP client against a loopback stand-in -------------------------------------------------

class _Recorder(BaseHTTPRequestHandler):
    calls: list[tuple[str, dict]] = []
    fail_update = False

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        route = self.path.strip("/")
        type(self).calls.append((route, body))
        failed = route == "update_weights_from_tensor" and type(self).fail_update
        answer = {"success": not failed, "message": "refit: boom" if failed else "Success"}
        data = json.dumps(answer).encode()
        self.send_response(400 if failed else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    _Recorder.calls = []
    _Recorder.fail_update = False
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_client_runs_sglangs_session_around_the_send(server: str) -> None:
    ticket = RefitTicket("127.0.0.1:29600", world_size=2, version=5)
    sent = threading.Event()
    result = HttpClient(server, tp_size=2).update(ticket, lambda: (sent.set(), "sent")[1], pause=PauseMode.RETRACT)
    assert result == "sent" and sent.is_set()
    routes = [route for route, _ in _Recorder.calls]
    assert routes == ["pause_generation", "begin_weight_update", "update_weights_from_tensor",
                      "end_weight_update", "continue_generation"]
    assert _Recorder.calls[0][1] == {"mode": "retract"}
    update = _Recorder.calls[2][1]
    assert update["load_format"] == LOAD_FORMAT and update["flush_cache"] is True
    assert update["weight_version"] == "5" and len(update["serialized_named_tensors"]) == 2
    raw = base64.b64decode(update["serialized_named_tensors"][1])
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        return  # decoded with SGLang's own deserializer in .venv-sglang
    assert RefitTicket.parse(MultiprocessingSerializer.deserialize(raw)) == ticket


def test_http_client_closes_the_session_and_raises_when_the_update_fails(server: str) -> None:
    _Recorder.fail_update = True
    ticket = RefitTicket("127.0.0.1:29600", world_size=1, version=1)
    with pytest.raises(RefitError, match="update_weights_from_tensor answered HTTP 400.*boom"):
        HttpClient(server, tp_size=1).update(ticket, lambda: None, pause=PauseMode.ABORT)
    assert [route for route, _ in _Recorder.calls][-2:] == ["end_weight_update", "continue_generation"]


def test_a_failing_send_is_raised_after_the_session_closes(server: str) -> None:
    def send() -> None:
        raise RefitError("train rank 0: peer died")

    with pytest.raises(RefitError, match="peer died"):
        HttpClient(server, tp_size=1).update(RefitTicket("127.0.0.1:29600", world_size=1, version=1), send)
    assert [route for route, _ in _Recorder.calls] == ["begin_weight_update", "update_weights_from_tensor",
                                                        "end_weight_update"]
