"""Beat packing in Python: the twin of templates/pack.h (tests check both agree).

A frame is one sample's tensor in torch order. Element k occupies bits [k*bits, (k+1)*bits)
of a bit string as its raw word (float32: IEEE-754 pattern; ap_fixed<W,I>: W-bit two's
complement of round(x * 2^(W-I)), half to even, saturated). Beat j is bits [j*W, (j+1)*W),
held as W/64 little-endian uint64 words. Beats per frame = ceil(numel*bits / W) by integer
ceil-division: the tail is zero-padded, never dropped.
"""

from __future__ import annotations

import numpy as np

from pipecc.targets.fpga_model import NumberFormat, parse_number


def beats_for(numel: int, bits: int, link_bits: int = 512) -> int:
    """Beats that carry `numel` elements of `bits` bits: (numel*bits + W - 1) // W."""
    return (int(numel) * int(bits) + link_bits - 1) // link_bits


def quantize(values: np.ndarray, number: str | NumberFormat) -> np.ndarray:
    """Values as the format holds them (float32, or ap_fixed with AP_RND_CONV, AP_SAT)."""
    fmt = parse_number(number)
    x = np.asarray(values, dtype=np.float64)
    if fmt.is_float:
        return x.astype(np.float32).astype(np.float64)
    return to_raw(x, fmt).astype(np.float64) * fmt.lsb


def to_raw(values: np.ndarray, number: str | NumberFormat) -> np.ndarray:
    """Signed integer words (int64) of the values: float32 bit patterns or fixed-point codes."""
    fmt = parse_number(number)
    x = np.asarray(values)
    if fmt.is_float:
        return x.astype(np.float32).view(np.uint32).astype(np.int64)
    hi = 2 ** (fmt.bits - 1)
    return np.clip(np.round(x.astype(np.float64) / fmt.lsb), -hi, hi - 1).astype(np.int64)


def from_raw(raw: np.ndarray, number: str | NumberFormat) -> np.ndarray:
    """Inverse of to_raw: float32 values."""
    fmt = parse_number(number)
    raw = np.asarray(raw, dtype=np.int64)
    if fmt.is_float:
        return raw.astype(np.uint32).view(np.float32)
    sign = 1 << (fmt.bits - 1)
    signed = ((raw & ((1 << fmt.bits) - 1)) ^ sign) - sign
    return (signed.astype(np.float64) * fmt.lsb).astype(np.float32)


def pack(values: np.ndarray, number: str | NumberFormat, link_bits: int = 512) -> np.ndarray:
    """One frame -> (beats, link_bits // 64) uint64 words."""
    fmt = parse_number(number)
    if link_bits % 64 or fmt.bits > 64:
        raise ValueError("link width must be a multiple of 64 and elements at most 64 bits")
    raw = to_raw(np.ravel(values), fmt).astype(np.uint64) & np.uint64((1 << fmt.bits) - 1)
    n = raw.size
    shifts = np.arange(fmt.bits, dtype=np.uint64)
    bits = ((raw[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.uint8).ravel()
    nbeats = beats_for(n, fmt.bits, link_bits)
    stream = np.zeros(nbeats * link_bits, dtype=np.uint8)
    stream[: bits.size] = bits
    return np.packbits(stream, bitorder="little").view("<u8").reshape(nbeats, link_bits // 64)


def unpack(words: np.ndarray, numel: int, number: str | NumberFormat,
           link_bits: int = 512) -> np.ndarray:
    """(beats, link_bits // 64) uint64 words -> `numel` float32 values."""
    fmt = parse_number(number)
    words = np.ascontiguousarray(words, dtype="<u8").ravel()
    need = beats_for(numel, fmt.bits, link_bits) * link_bits // 64
    if words.size < need:
        raise ValueError(f"{words.size} words hold fewer than {numel} elements of {fmt.bits} bits")
    bits = np.unpackbits(words[:need].view(np.uint8), bitorder="little")[: numel * fmt.bits]
    weights = np.uint64(1) << np.arange(fmt.bits, dtype=np.uint64)
    raw = (bits.reshape(numel, fmt.bits).astype(np.uint64) * weights).sum(1, dtype=np.uint64)
    return from_raw(raw.astype(np.int64), fmt)
