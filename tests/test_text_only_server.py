"""k3_ensemble on a text-only (`kimi_linear`) checkpoint, on a real tritonserver (issue 15).

k3_vision loads without a tower, so the ensemble serves the checkpoint: a text request gives what
k3_lm gives directly, and a request with an image ends with k3_vision's INVALID_ARG naming the cause.
The repository is a copy of model_repository/ with both models' `model_path` set to a tiny
text-only checkpoint (the tiny preset's language model, no tower and no preprocessor config).
"""

from __future__ import annotations

import json

import pytest

from k3client import http_post, stream_one
from k3backend.presets import make_checkpoint
from serverutil import repo_copy
from test_lm_server import png_data_uri

NO_TOWER = "k3_vision: INVALID_ARG: this checkpoint has no vision tower (model_type kimi_linear): it serves text only"


@pytest.fixture(scope="module")
def server(triton_server, tmp_path_factory):
    ckpt = make_checkpoint("tiny", tmp_path_factory.mktemp("text_only") / "ckpt", text_only=True)
    repo = repo_copy(tmp_path_factory.mktemp("text_only_repo") / "repo",
                     k3_vision={"model_path": str(ckpt)}, k3_lm={"model_path": str(ckpt)})
    server = triton_server(repo, ["k3_vision", "k3_lm", "k3_ensemble"], fresh=True)
    yield server
    server.stop()  # no later module uses this repository: free its memory now


def test_k3_vision_logs_that_it_loaded_without_a_tower(server):
    log = server.log_path.read_text()
    assert "k3_vision: loaded without a vision tower" in log and "model_type kimi_linear" in log
    assert "loaded kimi_linear" in log  # k3_lm's checkpoint line


def test_ensemble_text_request_equals_k3_lm_directly(server):
    values = {"text_input": "The capital of France is", "max_tokens": 16, "temperature": 0.0,
              "return_num_output_tokens": True}
    via_ensemble = stream_one(server.grpc_url, "k3_ensemble", values)
    direct = stream_one(server.grpc_url, "k3_lm", values)
    assert via_ensemble.error is None and via_ensemble.final and via_ensemble.text, via_ensemble.error
    assert direct.error is None and direct.final, direct.error
    assert via_ensemble.text == direct.text
    assert via_ensemble.total("num_output_tokens") == direct.total("num_output_tokens") > 0


@pytest.mark.parametrize("values", [
    {"text_input": "<|kimi_image_placeholder|>What is this?", "image_url_input": [png_data_uri()]},
    {"messages": json.dumps([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_uri()}}, {"type": "text", "text": "What is this?"}]}])},
], ids=["image_url_input", "chat-image"])
def test_ensemble_image_request_is_invalid_arg_naming_the_cause(server, values):
    bad = stream_one(server.grpc_url, "k3_ensemble", {"max_tokens": 4, **values})
    assert bad.error is not None and NO_TOWER in bad.error, bad.error
    status, body = http_post(server.http_url, "/v2/models/k3_ensemble/generate", {"max_tokens": 4, **values})
    assert status == 400 and NO_TOWER in json.loads(body)["error"], (status, body)
    good = stream_one(server.grpc_url, "k3_ensemble", {"text_input": "still fine", "max_tokens": 3})
    assert good.error is None and good.final
