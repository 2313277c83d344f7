"""What a weight-sync check compares, torch-free: the published weights' fingerprint (names, shapes, checksums: it
travels through the replay buffer, whose Ray process never imports torch), the comparison and its errors. The
checksums themselves: dppo.workers.weight_fingerprint."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorPrint:
    """One tensor's fingerprint: its shape and checksum (in the fingerprint's dtype)."""

    shape: tuple[int, ...]
    checksum: int


@dataclass
class WeightFingerprint:
    """The weights of one published version as a rollout engine should hold them: per checkpoint name, the shape and
    checksum in the engine's dtype. aliases: names that are another name's tensor (a tied lm_head), which an engine
    may hold once."""

    dtype: str  # the engine dtype the checksums were taken in ("bfloat16", ...)
    tensors: dict[str, TensorPrint] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # alias name -> the name whose tensor it is


class WeightSyncMismatchError(RuntimeError):
    """A rollout engine does not hold the weights it was given: the first tensor that differs, and the versions."""

    def __init__(self, tensor: str, version: int, detail: str, whose: str = "the rollout engine's"):
        """whose: what holds the tensor, as the message names it (a LoRA load's adapter: "the received adapter's")."""
        super().__init__(f"after loading version {version}, {whose} {tensor} {detail}")
        self.tensor, self.version, self.detail, self.whose = tensor, version, detail, whose

    def __reduce__(self):  # pickled across Ray and the local workers' pipes by its fields
        return type(self), (self.tensor, self.version, self.detail, self.whose)


class WeightSyncUnverifiableError(TypeError):
    """A tensor an engine holds could not be mapped back to a checkpoint name: its weights cannot be verified."""


def verify(
    expected: WeightFingerprint, held: dict[str, TensorPrint], version: int, whose: str = "the rollout engine's"
) -> None:
    """WeightSyncMismatchError naming the first tensor (in the checkpoint's order) whose held print differs from the
    expected one, or that the engine does not hold; held: what the engine reported, by checkpoint name (an engine
    that keeps its own layout maps it back first: vLLM's fused q/k/v and gate/up, its stacked experts). Compared by
    name only: two tensors of equal values are common (fresh norm weights of ones, zero biases), so a print found
    under another name says nothing of the missing one. The one name an engine may leave out is a tied one (vLLM
    holds a tied lm_head once, as the embedding): accepted where the publish says it is one tensor with a name the
    engine holds (expected.aliases). A reload that dropped a tensor leaves the old one in place, which is reported
    and differs."""
    for name, want in expected.tensors.items():
        got = held.get(name)
        if got is None and any(tied in held for tied in _tied_with(expected.aliases, name)):
            continue
        if got is None:
            raise WeightSyncMismatchError(name, version, "is missing: the engine reported no such tensor", whose)
        if got.shape != want.shape:
            raise WeightSyncMismatchError(
                name, version, f"has shape {list(got.shape)}; published: {list(want.shape)}", whose
            )
        if got.checksum != want.checksum:
            raise WeightSyncMismatchError(
                name,
                version,
                f"differs from the published tensor (checksum {got.checksum:#x} in {expected.dtype}, "
                f"published {want.checksum:#x})",
                whose,
            )
    extra = sorted(held.keys() - expected.tensors.keys())
    if extra:
        raise WeightSyncMismatchError(
            extra[0], version, "was not published (the engine holds a tensor the trainer has none of)", whose
        )


def _tied_with(aliases: dict[str, str], name: str) -> set[str]:
    """The other names of name's tensor in a publish whose ties are aliases (alias -> the name whose tensor it is)."""
    owner = aliases.get(name, name)
    return ({owner} | {alias for alias, of in aliases.items() if of == owner}) - {name}
