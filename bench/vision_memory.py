"""k3_vision memory under large images: RSS after each request, with and without the heap trim.

    .venv/bin/python bench/vision_memory.py [--sizes 9000x9000,4000x3000,2400x2400] [--in-patch-limit N]

Runs `VisionServer` in-process (the logic behind k3_vision, the repository's config.pbtxt
parameters, the built-in tiny checkpoint, one torch thread as each of the two CPU instances
gets on a 2-core machine). Each mode runs in a fresh process so that both start from the same
baseline: `trim` is the code as shipped, `no-trim` disables the heap trim after large batches.
The images are smooth PNGs (small files, full-size decode), written once by the parent. Prints
the command, versions, and one table: per request the time, the RSS after it and the peak RSS so far.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
PH = "<|kimi_image_placeholder|>"


def smooth_png(w: int, h: int) -> bytes:
    """A horizontal gradient: every pixel decoded and resized, a file of a few hundred kB."""
    row = (np.arange(w) * 255 // max(1, w - 1)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.repeat(np.broadcast_to(row[None, :, None], (h, w, 1)), 3, axis=2)).save(buf, "PNG")
    return buf.getvalue()


def run_mode(mode: str, files: list[Path], in_patch_limit: str) -> list[dict]:
    """One row per request (plus the baseline) in this process."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from k3backend.serving import vision_adapter
    from k3backend.serving.heap import rss_bytes
    from k3backend.serving.vision_adapter import VisionRequest, VisionServer

    pbtxt = (ROOT / "model_repository" / "k3_vision" / "config.pbtxt").read_text()
    config = json_format.MessageToDict(text_format.Parse(pbtxt, model_config_pb2.ModelConfig()),
                                       preserving_proto_field_name=True)
    config["parameters"]["in_patch_limit"] = {"string_value": in_patch_limit}
    if mode == "no-trim":
        vision_adapter.TRIM_AFTER_BYTES = float("inf")
    server = VisionServer.from_model_config(config)
    torch.set_num_threads(1)
    server.warm_up()
    def row(name: str, seconds: float, grid: str) -> dict:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"request": name, "seconds": seconds, "grid": grid, "rss": rss_bytes(), "peak": peak}

    rows = [row("baseline", 0.0, "")]
    for path in files:
        data = base64.b64encode(path.read_bytes())
        start = time.perf_counter()
        (out,) = server.execute([VisionRequest(text_input=PH.encode(), image=[data])])
        took = time.perf_counter() - start
        if not isinstance(out, dict):
            raise SystemExit(f"{path.stem}: {out.code}: {out}")
        rows.append(row(path.stem, took, "x".join(map(str, out["image_grid_thw"][0, 0].tolist()))))
        del out, data
    server.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="9000x9000,4000x3000,2400x2400", help="W x H of each request's image")
    ap.add_argument("--in-patch-limit", default="", help="k3_vision parameter (default: the checkpoint's)")
    ap.add_argument("--child", choices=["trim", "no-trim"], help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        files = [Path(f) for f in args.files.split(",")]
        print(json.dumps(run_mode(args.child, files, args.in_patch_limit)))
        return 0

    print("command:", " ".join(sys.argv))
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
          f"glibc {platform.libc_ver()[1] or '?'}, 1 torch thread, CPU")
    table = {}
    with tempfile.TemporaryDirectory(prefix="vision_memory.") as tmp:
        files = []
        for size in args.sizes.split(","):
            w, h = (int(v) for v in size.split("x"))
            files.append(Path(tmp) / f"{w}x{h}.png")
            files[-1].write_bytes(smooth_png(w, h))
        for mode in ("trim", "no-trim"):
            proc = subprocess.run([sys.executable, __file__, "--child", mode, "--files", ",".join(map(str, files)),
                                   "--in-patch-limit", args.in_patch_limit], capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stderr[-3000:])
                return proc.returncode
            table[mode] = json.loads(proc.stdout.strip().splitlines()[-1])

    mib = 2**20
    print(f"\n{'request':<12} {'grid':>12} {'s (trim)':>9} {'RSS trim':>9} {'RSS no-trim':>12} "
          f"{'peak trim':>10} {'peak no-trim':>13}   (MiB)")
    for a, b in zip(table["trim"], table["no-trim"]):
        print(f"{a['request']:<12} {a['grid']:>12} {a['seconds']:>9.1f} {a['rss'] / mib:>9.0f} {b['rss'] / mib:>12.0f} "
              f"{a['peak'] / mib:>10.0f} {b['peak'] / mib:>13.0f}")
    for mode, rows in table.items():
        print(f"{mode}: RSS {rows[0]['rss'] / mib:.0f} -> {rows[-1]['rss'] / mib:.0f} MiB "
              f"({(rows[-1]['rss'] - rows[0]['rss']) / mib:+.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
