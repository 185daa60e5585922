"""Stream a K3 chat completion (optionally with images) from k3_ensemble over gRPC.

    python examples/chat_stream.py --prompt "Describe the image." --image cat.png
    python examples/chat_stream.py --url localhost:8001 --prompt "Hello" --max-tokens 64 --temperature 0

Images travel as data URIs inside the `messages` JSON; `k3_vision` encodes them and `k3_lm`
streams the answer. Ctrl-C sends the stop convention so the server frees the request. Both are
described in docs/client-api.md ("Images", "Cancellation").
"""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import queue
import sys
import uuid

import numpy as np
import tritonclient.grpc as grpcclient


def tensor(name: str, value, dtype: str) -> grpcclient.InferInput:
    arr = np.array([[value.encode() if isinstance(value, str) else value]],
                   dtype={"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}[dtype])
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def data_uri(path: str) -> str:
    mime = mimetypes.guess_type(path)[0] or "image/png"
    with open(path, "rb") as f:
        return f"data:{mime};base64," + base64.b64encode(f.read()).decode()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="k3_ensemble")
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--thinking", action="store_true")
    args = p.parse_args()

    content = [{"type": "image_url", "image_url": {"url": data_uri(f)}} for f in args.image]
    content.append({"type": "text", "text": args.prompt})
    inputs = [tensor("text_input", "", "BYTES"),
              tensor("messages", json.dumps([{"role": "user", "content": content}]), "BYTES"),
              tensor("chat_template_kwargs", json.dumps({"thinking": args.thinking}), "BYTES"),
              tensor("max_tokens", args.max_tokens, "INT32"), tensor("temperature", args.temperature, "FP32"),
              tensor("stream", True, "BOOL"), tensor("return_finish_reason", True, "BOOL"),
              tensor("return_num_input_tokens", True, "BOOL"), tensor("return_num_output_tokens", True, "BOOL"),
              tensor("return_reasoning", True, "BOOL")]
    request_id = str(uuid.uuid4())
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer(args.model, inputs, request_id=request_id)
    n_out, n_in, reason = 0, 0, ""
    try:
        while True:
            result, error = events.get()
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            resp = result.get_response()
            names = {o.name for o in resp.outputs}
            if "reasoning_output" in names:
                sys.stderr.write(result.as_numpy("reasoning_output").reshape(-1)[0].decode())
            if "text_output" in names:
                sys.stdout.write(result.as_numpy("text_output").reshape(-1)[0].decode())
                sys.stdout.flush()
                n_out += int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                n_in = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
                reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
            if resp.parameters["triton_final_response"].bool_param:
                break
    except KeyboardInterrupt:  # stop convention: the server ends and frees the request
        client.async_stream_infer(args.model, [tensor("text_input", "", "BYTES"), tensor("stop", True, "BOOL")],
                                  request_id=request_id)
    finally:
        client.stop_stream()
        client.close()
    print(f"\n[{n_in} prompt tokens, {n_out} output tokens, finish_reason={reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
