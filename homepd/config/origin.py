"""Which serving configuration an engine runs, and why: applied advice, the built-in default, or the user's own
choice.  ``homepd serve`` logs it at start-up and shows it in ``/status``; the app shows it in its header.

Pure: the values in effect, the defaults, what the config file set and its ``[advice]`` table in; a
``ConfigOrigin`` out (``homepd.launch.config_origin`` reads the file).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from homepd.core.modes import Mode

# the EngineConfig fields a serving configuration (an advise candidate) consists of, by the mode they matter in
SERVING_FIELDS: dict[str, tuple[Mode, ...]] = {
    "mode": tuple(Mode), "chunk": tuple(Mode), "adaptive_chunk": tuple(Mode),
    **{name: tuple(m for m in Mode if name in m.traits.config_fields)
       for m in Mode for name in m.traits.config_fields}}


class ConfigSource(enum.StrEnum):
    ADVICE = "advice"       # `homepd advise apply` wrote it, and nothing overrides it
    DEFAULT = "default"     # no advice applied and nothing set: the built-in default
    CHOSEN = "chosen"       # set by flags, HOMEPD_* or the config file by hand (or overriding the advice)


@dataclass(frozen=True)
class ConfigOrigin:
    """``configuration``: the configuration in words ("colocated, adaptive chunk (at most 256)"); ``why``: where
    it came from ("applied advice from run 12 (candidate colocated-adaptive)", "built-in default ...")."""
    source: ConfigSource
    configuration: str
    why: str
    run_id: int | None = None
    candidate: str | None = None

    @property
    def line(self) -> str:
        return f"running {self.configuration} — {self.why}"

    def to_dict(self) -> dict:
        return {"source": self.source.value, "configuration": self.configuration, "why": self.why,
                "run_id": self.run_id, "candidate": self.candidate}

    @classmethod
    def from_dict(cls, data: dict) -> "ConfigOrigin":
        return cls(ConfigSource(data["source"]), str(data["configuration"]), str(data["why"]),
                   data.get("run_id"), data.get("candidate"))


def config_origin(effective: dict, defaults: dict, from_file: dict, advice: dict, configuration: str
                  ) -> ConfigOrigin:
    """Why ``effective`` (field -> value in force) is what runs.  ``from_file``: the fields the config file sets;
    ``advice``: its ``[advice]`` table (``run``, ``candidate``), {} when no advice was applied."""
    mode = Mode(effective["mode"])
    fields = [name for name, modes in SERVING_FIELDS.items() if mode in modes]
    if advice.get("run") is not None:
        label = f"run {advice['run']}" + (f" (candidate {advice['candidate']})" if advice.get("candidate") else "")
        overridden = [n for n in fields if n in from_file and from_file[n] != effective[n]]
        if not overridden:
            return ConfigOrigin(ConfigSource.ADVICE, configuration, f"applied advice from {label}",
                                advice["run"], advice.get("candidate"))
        return ConfigOrigin(ConfigSource.CHOSEN, configuration,
                            f"advice from {label} overridden by flags or HOMEPD_* ({_values(effective, overridden)})",
                            advice["run"], advice.get("candidate"))
    changed = [n for n in fields if effective[n] != defaults[n]]
    if not changed:
        return ConfigOrigin(ConfigSource.DEFAULT, configuration,
                            "built-in default: no advice applied (`homepd advise`, then `homepd advise apply`)")
    return ConfigOrigin(ConfigSource.CHOSEN, configuration,
                        f"set by flags, HOMEPD_* or the config file ({_values(effective, changed)})")


def _values(effective: dict, names: list[str]) -> str:
    return ", ".join(f"{n}={'none' if effective[n] is None else effective[n]}" for n in names)
