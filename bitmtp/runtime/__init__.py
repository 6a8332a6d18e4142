"""Runtime layer: the in-place KV store, replay states, the graph pool and the decode engine."""

from bitmtp.runtime.decode import DecodeStats, GenerationResult
from bitmtp.runtime.engine import Engine
from bitmtp.runtime.kv import KVStore
from bitmtp.runtime.states import ReplayState

__all__ = ["DecodeStats", "Engine", "GenerationResult", "KVStore", "ReplayState"]
