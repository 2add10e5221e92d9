"""An fp32 master as the bits its bf16 parameter lacks: 16 low bits and one carry bit, exact.

A bf16 parameter is its master rounded to nearest even (``param.copy_(master)``), so the device already holds the
master's sign, exponent and top mantissa bits, up to the rounding. Write the master's 32 bits as a high and a low half.
Rounding keeps the high half or adds one to it (the carry); the low half says which, except at a tie (low half
``0x8000``), where an even bf16 is reached from both sides: 65,537 fp32 values round to it, one more than 16 bits can
tell apart. So the remainder is the low half (:data:`LOW_DTYPE`, 2 bytes) and the carry (1 bit, packed 8 to a byte):
2.125 bytes a parameter instead of 4, and the master is rebuilt exactly from the parameter as it is on the device::

    high = bits(param) - carry;  master = high << 16 | low

Every value is rebuilt bit for bit, infinities and values that round to one included; a NaN master (whose bf16 cast
is a NaN of the device's choosing) is rebuilt as a NaN. Only bf16 parameters qualify (:func:`has_remainder_form`):
an fp16 parameter's exponent range differs from fp32's, so its cast is not a rounding of the master's high half.

The kernels are plain torch operations on views of the tensors' bytes (halves of little-endian words), run on the
tensors' device: no copy leaves it.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

__all__ = [
    "LOW_DTYPE",
    "MasterRemainder",
    "has_remainder_form",
    "join_master",
    "rebuild_master",
    "remainder_nbytes",
    "remainder_numel",
    "split_master",
]

LOW_DTYPE = torch.int16
"""The dtype of a remainder's low halves."""

_BITS = 8
"""Carry bits packed into one byte."""


@dataclasses.dataclass(frozen=True)
class MasterRemainder:
    """What a master adds to its bf16 parameter: its low halves, and its carries packed 8 to a byte (the first
    element's in the lowest bit)."""

    low: torch.Tensor
    """One :data:`LOW_DTYPE` element per master element."""
    carry: torch.Tensor
    """``ceil(numel / 8)`` ``uint8`` bytes."""

    @classmethod
    def packed(cls, data: torch.Tensor, numel: int) -> MasterRemainder:
        """The remainder of a master of ``numel`` elements kept in one flat ``uint8`` tensor of
        :func:`remainder_nbytes` bytes: the low halves first, then the carry bytes (views: writes land in ``data``).
        """
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != remainder_nbytes(numel):
            raise ValueError(
                f"A packed remainder of a master of {numel} elements is a flat uint8 tensor of "
                f"{remainder_nbytes(numel)} bytes, got {data.dtype} of shape {tuple(data.shape)}"
            )
        return cls(data[: 2 * numel].view(LOW_DTYPE), data[2 * numel :])


def has_remainder_form(param_dtype: torch.dtype) -> bool:
    """Whether a master of a parameter of ``param_dtype`` can be kept as its remainder (bf16 only, see the module)."""
    return param_dtype == torch.bfloat16


def remainder_nbytes(numel: int) -> int:
    """Bytes of the remainder of a master of ``numel`` elements (2.125 a parameter, the carry bytes rounded up)."""
    return 2 * numel + -(-numel // _BITS)


def remainder_numel(nbytes: int) -> int:
    """The elements of the master a remainder of ``nbytes`` bytes keeps (the inverse of :func:`remainder_nbytes`,
    which raises ``ValueError`` for a size no master has)."""
    numel = nbytes * _BITS // (2 * _BITS + 1)
    while remainder_nbytes(numel + 1) <= nbytes:
        numel += 1
    if remainder_nbytes(numel) != nbytes:
        raise ValueError(f"No master's remainder takes {nbytes} bytes")
    return numel


def split_master(master: torch.Tensor, param: torch.Tensor, out: MasterRemainder | None = None) -> MasterRemainder:
    """The remainder of ``master`` (fp32) over ``param``, its bf16 cast (``param.copy_(master)`` just ran), into
    ``out`` (new tensors when ``None``)."""
    _check(master, param)
    halves = master.reshape(-1).view(torch.int16)
    low, high = halves[0::2], halves[1::2]
    carried = (param.reshape(-1).view(torch.int16) != high) & ~master.reshape(-1).isnan()
    if out is None:
        return MasterRemainder(low.clone(), _pack(carried))
    _check_fits(out, param.numel())
    out.low.copy_(low)
    out.carry.copy_(_pack(carried))
    return out


def join_master(param: torch.Tensor, remainder: MasterRemainder, out: torch.Tensor | None = None) -> torch.Tensor:
    """The master ``param`` (bf16) and ``remainder`` were split from, bit for bit (a NaN as a NaN), into ``out`` (an
    fp32 tensor of ``param``'s shape; a new one when ``None``)."""
    master = torch.empty(param.shape, dtype=torch.float32, device=param.device) if out is None else out
    _check(master, param)
    numel = param.numel()
    _check_fits(remainder, numel)
    halves = master.reshape(-1).view(torch.int16)
    carries = _unpack(remainder.carry, numel).to(torch.int16)
    # A carry is 1 only where rounding added one to the high half, so this never wraps.
    torch.sub(param.reshape(-1).view(torch.int16), carries, out=halves[1::2])
    halves[0::2].copy_(remainder.low)
    return master


def rebuild_master(param: torch.Tensor, remainder: MasterRemainder, out: torch.Tensor | None = None) -> torch.Tensor:
    """The master of ``param`` as the next update starts from it: :func:`join_master`, where that rounds to
    ``param``; elsewhere ``param`` itself, exactly.

    The two differ only where ``param`` changed since ``remainder`` was split from its master (an edit between
    steps that torch may not even count, such as ``p.data.zero_()``): there the old carry and low half may not
    belong to the new high half (joined, a zero minus a carry is a NaN). So an edited parameter keeps its edit:
    its master is the edited value with the old master's bits below bf16's precision where those still round to
    it, else the edited value exactly. Unedited, every element rounds back (the all-patterns test), so this is
    :func:`join_master` bit for bit.
    """
    master = join_master(param, remainder, out)
    flat, bits = master.reshape(-1), param.reshape(-1)
    rounds_back = flat.to(torch.bfloat16).view(torch.int16) == bits.view(torch.int16)
    torch.where(rounds_back, flat, bits.to(torch.float32), out=flat)
    return master


def _check_fits(remainder: MasterRemainder, numel: int) -> None:
    if remainder.low.numel() != numel or remainder.carry.numel() != -(-numel // _BITS):
        raise ValueError(
            f"A remainder of {remainder.low.numel()} low halves and {remainder.carry.numel()} carry bytes does not "
            f"fit a parameter of {numel} elements (it needs {numel} and {-(-numel // _BITS)})"
        )


def _check(master: torch.Tensor, param: torch.Tensor) -> None:
    if sys.byteorder != "little":
        raise RuntimeError("Master remainders read the halves of little-endian words; this host is big-endian")
    if master.dtype != torch.float32 or param.dtype != torch.bfloat16:
        raise ValueError(
            f"A master remainder needs an fp32 master and a bf16 parameter, got {master.dtype} and {param.dtype}"
        )
    if master.shape != param.shape or not master.is_contiguous():  # the parameter is read in logical order
        raise ValueError(
            f"A master remainder needs a contiguous master of its parameter's shape, got {tuple(master.shape)} "
            f"and {tuple(param.shape)}"
        )


def _pack(bits: torch.Tensor) -> torch.Tensor:
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, -bits.numel() % _BITS))
    weights = torch.tensor([1 << bit for bit in range(_BITS)], dtype=torch.uint8, device=bits.device)
    return (padded.view(-1, _BITS) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(_BITS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel]
