"""Async probes: device-side NaN / Inf / out-of-range / page-alignment assertions (SPEC §6)."""
