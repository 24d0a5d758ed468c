"""Triton's management answers for the reward server: model configuration, statistics and the
repository index, in the schemas Triton's protocol documents, so tools written for Triton
(``tritonclient``'s ``get_model_config`` / ``get_inference_statistics`` /
``get_model_repository_index``, perf_analyzer, dashboards) read them unchanged::

    GET  /v2/models/{name}[/versions/{v}]/config   the model configuration (model_config.proto as JSON)
    GET  /v2/models[/{name}[/versions/{v}]]/stats  {"model_stats": [$model_stat]} (statistics extension)
    POST /v2/repository/index                      [{"name", "version", "state"}] (repository extension)

The configuration follows protobuf's JSON mapping as Triton prints it (64-bit integers such as
``dims`` are strings). Requests carry one item each ([1, N] tensors: batch 1 with
``max_batch_size`` > 0), and the server batches them dynamically, as a Triton model with
``dynamic_batching`` does. ttsrl's own settings (reward variant, backend, SIM and MOS weights) travel as
the configuration's ``parameters``.

Statistics count what Triton counts: ``inference_count`` items scored, ``execution_count``
batches, ``success``/``fail`` the whole request in the server, ``queue`` the wait in the
batcher, ``compute_input`` the parsing of the body, ``compute_infer`` the backend batch (each
request charged its batch's time, as Triton does), ``compute_output`` building the answer;
``batch_stats`` per batch size. Durations are nanoseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ttsrl.reward.protocol import INPUT_SPECS, MODEL_VERSION, OPTIONAL_INPUT_SPECS, OUTPUT_SPECS

#: KServe v2 datatypes -> the data_type names of Triton's model configuration
CONFIG_TYPES = {"INT32": "TYPE_INT32", "FP32": "TYPE_FP32", "BYTES": "TYPE_STRING"}
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")


@dataclass
class Duration:
    """Triton's $duration_stat: how many, and their total nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += int(ns)

    def as_dict(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class TritonStats:
    """Counters behind Triton's $model_stat (kept by the server and the batcher)."""

    durations: dict[str, Duration] = field(default_factory=lambda: {k: Duration() for k in DURATIONS})
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0  # milliseconds since the epoch of the last successful inference
    batch_infer: dict[int, Duration] = field(default_factory=dict)  # batch size -> executions, their ns

    def executed(self, size: int, ns: int) -> None:
        """One backend batch of ``size`` items took ``ns``."""
        ns = int(ns)
        self.execution_count += 1
        self.durations["compute_infer"].add(ns * size, size)
        self.batch_infer.setdefault(size, Duration()).add(ns)

    def model_stat(self, name: str) -> dict:
        return {
            "name": name, "version": MODEL_VERSION, "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count, "execution_count": self.execution_count,
            "inference_stats": {k: d.as_dict() for k, d in self.durations.items()},
            "response_stats": {},
            "batch_stats": [{"batch_size": size, "compute_input": Duration().as_dict(),
                             "compute_infer": d.as_dict(), "compute_output": Duration().as_dict()}
                            for size, d in sorted(self.batch_infer.items())],
            "memory_usage": [],
        }


def model_config(name: str, *, max_batch: int, max_delay_ms: float, max_queue: int, devices: list[str],
                 parameters: dict[str, str]) -> dict:
    """Triton's model configuration of the reward model, as ``GET .../config`` returns it."""
    optional = {n for n, _, _ in OPTIONAL_INPUT_SPECS}

    def tensors(specs):
        # the batch dimension (the leading 1 of every [1, ...] shape) is implicit with max_batch_size > 0
        return [{"name": n, "data_type": CONFIG_TYPES[d], "format": "FORMAT_NONE",
                 "dims": [str(x) for x in s[1:]], "is_shape_tensor": False, "optional": n in optional}
                for n, d, s in specs]

    gpus = [int(d.partition(":")[2] or 0) for d in devices if d.startswith("cuda")]
    group = ({"name": f"{name}_0", "kind": "KIND_GPU", "count": 1, "gpus": gpus} if gpus
             else {"name": f"{name}_0", "kind": "KIND_CPU", "count": len(devices), "gpus": []})
    return {
        "name": name, "platform": "", "backend": "ttsrl",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": int(max_batch),
        "input": tensors(INPUT_SPECS + OPTIONAL_INPUT_SPECS),  # PROMPT_ID: "optional": true
        "output": [{k: v for k, v in t.items() if k not in ("format", "optional")} for t in tensors(OUTPUT_SPECS)],
        "dynamic_batching": {"preferred_batch_size": [], "max_queue_delay_microseconds": str(int(max_delay_ms * 1000)),
                             "preserve_ordering": False,
                             "default_queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": "0",
                                                      "allow_timeout_override": False,
                                                      "max_queue_size": int(max_queue)}},
        "instance_group": [group],
        "parameters": {k: {"string_value": str(v)} for k, v in parameters.items()},
    }


def repository_index(name: str, ready: bool) -> list[dict]:
    """Triton's repository index: the one model this server holds and its state."""
    entry = {"name": name, "version": MODEL_VERSION, "state": "READY" if ready else "UNAVAILABLE"}
    if not ready:
        entry["reason"] = "the reward server is still loading its backends"
    return [entry]
