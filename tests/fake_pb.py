"""A small stand-in for `triton_python_backend_utils`, for fast tests of the adapters without a
server (the end-to-end tests use a real tritonserver). It records what a model sends."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch


class FakePbUtils:
    """The parts of triton_python_backend_utils that the adapters and metrics use."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError:
        INTERNAL, INVALID_ARG, UNSUPPORTED, UNAVAILABLE, CANCELLED = range(5)

        def __init__(self, message: str, code: int = 0) -> None:
            self.message, self.code = message, code

        def __repr__(self) -> str:
            return f"TritonError({self.message!r})"

    class Tensor:
        def __init__(self, name: str, value: Any) -> None:
            self.name, self.value = name, value

        @classmethod
        def from_dlpack(cls, name: str, capsule: Any) -> FakePbUtils.Tensor:
            return cls(name, torch.utils.dlpack.from_dlpack(capsule))

        def as_numpy(self) -> Any:
            return self.value

    class InferenceResponse:
        def __init__(self, output_tensors: list, error: Any = None) -> None:
            self.output_tensors, self.error = output_tensors, error

        def outputs(self) -> dict[str, Any]:
            return {t.name: t.value for t in self.output_tensors}

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        created: list[tuple[str, str]] = []

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name = name
            FakePbUtils.MetricFamily.created.append((name, kind))

        def Metric(self, labels: dict, buckets: list | None = None) -> FakeMetric:  # noqa: N802
            return FakeMetric(self.name, labels, buckets)

    class Request:
        """A request as a model's execute() gets it: inputs, id, parameters and a response sender."""

        def __init__(self, inputs: dict[str, np.ndarray], request_id: str = "", parameters: str = "{}",
                     sender: FakeSender | None = None) -> None:
            self._inputs, self.id, self._parameters = inputs, request_id, parameters
            self.sender = sender or FakeSender()

        def inputs(self) -> list[Any]:
            """Tensors with name() and as_numpy(); a callable value raises (or computes) when read."""
            return [_InputTensor(name, value) for name, value in self._inputs.items()]

        def request_id(self) -> str:
            return self.id

        def parameters(self) -> str:
            return self._parameters

        def get_response_sender(self) -> FakeSender:
            return self.sender

        def is_cancelled(self) -> bool:
            return self.sender.cancelled

    @staticmethod
    def get_input_tensor_by_name(request: Any, name: str) -> Any:  # as pb_utils: a scan of inputs()
        return next((t for t in request.inputs() if t.name() == name), None)

    @staticmethod
    def unload_model(name: str, unload_dependents: bool = False) -> None:
        raise RuntimeError("no server")


class _InputTensor:
    """An input as pb_utils gives it (name() is a method there, unlike the outputs' fake Tensor)."""

    def __init__(self, name: str, value: Any) -> None:
        self._name, self._value = name, value

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> Any:
        return self._value() if callable(self._value) else self._value


class FakeSender:
    """Records responses; `delay_s` makes every send slow (a client that reads slowly); a `gate` holds
    every send until it is set; `log` gets (name, flags) of each send, shared by several senders."""

    def __init__(self, delay_s: float = 0.0, gate: threading.Event | None = None, log: list | None = None,
                 name: str = "") -> None:
        self.responses: list[FakePbUtils.InferenceResponse] = []
        self.flags: list[int] = []
        self.delay_s, self.gate, self.log, self.name = delay_s, gate, log, name
        self.cancelled = False
        self.final = threading.Event()
        self.after_final: list[str] = []  # calls made after the final response: each is a defect

    def send(self, response: Any = None, flags: int = 0) -> None:
        if self.final.is_set():
            self.after_final.append("send")
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.gate is not None:
            self.gate.wait()
        if self.log is not None:
            self.log.append((self.name, flags))
        self.responses.append(response)
        self.flags.append(flags)
        if flags & FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.final.set()

    def is_cancelled(self) -> bool:
        if self.final.is_set():
            self.after_final.append("is_cancelled")
        return self.cancelled

    def outputs(self) -> list[dict[str, Any]]:
        return [r.outputs() for r in self.responses if r.error is None]

    @property
    def error(self) -> Any:
        return next((r.error for r in self.responses if r.error is not None), None)


class FakeMetric:
    def __init__(self, name: str, labels: dict, buckets: list | None) -> None:
        self.name, self.labels, self.buckets, self.values = name, labels, buckets, []

    def increment(self, v: float) -> None:
        self.values.append(v)

    def observe(self, v: float) -> None:
        self.values.append(v)

    def set(self, v: float) -> None:
        self.values.append(v)
