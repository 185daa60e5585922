"""k3_vision: images -> embeddings for k3_lm (docs/client-api.md).

Thin Triton shell; the logic is in `k3backend.serving.vision_adapter`. `execute` never raises:
every failure becomes that request's error response `k3_vision: <CODE>: <detail>` [VIS-7].
"""

import triton_python_backend_utils as pb_utils

from k3backend.serving.vision_adapter import triton_execute, triton_initialize


class TritonPythonModel:
    def initialize(self, args):
        # Parameters, metrics, tower and projector, one warm-up image [HLT-3]; raising fails the load.
        self.server = triton_initialize(pb_utils, args)

    def execute(self, requests):
        return triton_execute(pb_utils, self.server, requests)

    def finalize(self):
        self.server.close()
