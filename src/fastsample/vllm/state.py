"""The plugin's process-wide state: whether it is installed, what it replaced, its counters.

Nothing here imports vLLM. ``CALLS`` counts what the plugin did (tests read it to show the
tokens came from fastsample; the benchmark reports it); counting is a dict increment per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CALLS: dict[str, int] = {
    "sample": 0,  # sampler steps drawn by fastsample.sample_step
    "verify": 0,  # rejection-sampler steps verified by fastsample.verify_chain
    "delegated": 0,  # steps handed to vLLM's own code (vllm_sampling(), unsupported batch)
    "plans": 0,  # StepParams/TokenStats builds (batch composition changes)
    "stats_rebuilds": 0,  # TokenStats rebuilt because the host's output lengths disagreed
    "bitmasks": 0,  # grammar bitmasks that reached sample_step / verify_chain
}


@dataclass
class PluginState:
    installed: bool = False
    delegate: bool = False  # vllm_sampling(): run vLLM's own code
    warned: set[str] = field(default_factory=set)
    # (module, name, original value) of every name the installer replaced
    replaced: list[tuple[Any, str, Any]] = field(default_factory=list)
    # runners the installer hooked ("v1", "mrv2") and those built since ("v1", "mrv2")
    hooked: set[str] = field(default_factory=set)
    runners: set[str] = field(default_factory=set)


STATE = PluginState()


def reset_calls() -> None:
    for key in CALLS:
        CALLS[key] = 0
