"""k3_lm: thin Triton Python-backend adapter; the logic lives in k3backend.serving.lm_adapter."""

import json

import triton_python_backend_utils as pb_utils

from k3backend.serving.lm_adapter import LmServer


class TritonPythonModel:
    def initialize(self, args):
        self.server = LmServer(json.loads(args["model_config"]), pb_utils, version=args["model_version"])

    def execute(self, requests):
        self.server.execute(requests)
        return None

    def finalize(self):
        self.server.close()
