"""Which LoRA adapters the cluster serves, as its live workers registered them.

A worker lists its adapters, name -> identity (``Register.lora_adapters``, ``LoRAState``;
``engine.lora.adapter_identity``: the adapter's files). The first live worker to register a
name sets the identity the cluster knows it by; a later worker whose files differ under that
name keeps its other adapters, but that name is never placed on it (logged, and listed in its
``conflicting_lora_adapters``). A name is known while some live worker holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvrelay.router.instance import Instance

logger = logging.getLogger(__name__)


class LoraCatalog:
    def __init__(self) -> None:
        self._loras: dict[str, tuple[bytes, int]] = {}  # name -> (identity, live holders)

    def admit(self, inst: Instance, adapters: Mapping[str, bytes]) -> None:
        """Gives ``inst`` (whose adapters are counted out) the adapters whose identity agrees
        with every other live worker's adapter of that name, and counts them in; the others
        are its conflicts."""
        known = {name: fp for name, (fp, _) in self._loras.items()}
        inst.lora_adapters, conflicts = {}, []
        for name, fp in adapters.items():
            if known.get(name, fp) == fp:
                inst.lora_adapters[name] = fp
            else:
                conflicts.append(name)
                logger.error(
                    "%s %s registered LoRA adapter %r with identity %s, but the cluster serves "
                    "%r as %s: it gets no request for it (load the same files everywhere, or "
                    "another name)",
                    inst.role.value, inst.instance_id, name, fp.hex()[:16], name,
                    known[name].hex()[:16],
                )  # fmt: skip
        inst.conflicting_lora_adapters = tuple(sorted(conflicts))
        self._count(inst, 1)

    def release(self, inst: Instance) -> None:
        """Counts ``inst``'s adapters out (it left, or registers them anew)."""
        self._count(inst, -1)

    def _count(self, inst: Instance, change: int) -> None:
        for name, fp in inst.lora_adapters.items():
            count = self._loras.get(name, (fp, 0))[1] + change
            if count:
                self._loras[name] = (fp, count)
            else:
                del self._loras[name]

    def adapters(self) -> dict[str, bytes]:
        """The adapters some live worker holds, name -> identity (sorted by name)."""
        return {name: fp for name, (fp, _) in sorted(self._loras.items())}

    def holders(self) -> dict[str, int]:
        """Name -> how many live workers hold it (``Registry.check_integrity``)."""
        return {name: n for name, (_, n) in self._loras.items()}

    def identity(self, name: str) -> bytes | None:
        """The identity of adapter ``name`` as live workers hold it; None if none does."""
        entry = self._loras.get(name)
        return None if entry is None else entry[0]
