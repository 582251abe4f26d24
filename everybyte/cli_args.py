"""argparse types for bounded numbers: a flag given out of range is a usage error that names the
flag and the range (argparse adds the flag), instead of a run that silently does something else
(a negative --max-sessions slicing sessions off the end, a negative rate, a zero timeout)."""
from __future__ import annotations

import argparse
import math
from typing import Callable


def _number(kind: type, text: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(_number(int, text))
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text!r}")
        return value
    parse.__name__ = f"int >= {low}"              # argparse names the type in its own messages
    return parse


def float_at_least(low: float, strict: bool = False) -> Callable[[str], float]:
    """A number >= low (> low when strict)."""
    def parse(text: str) -> float:
        value = _number(float, text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
        return value
    parse.__name__ = f"number {'>' if strict else '>='} {low:g}"
    return parse


positive = float_at_least(0.0, strict=True)
non_negative = float_at_least(0.0)
count = int_at_least(1)
non_negative_int = int_at_least(0)


def counts(flag: str, text: str) -> list[int]:
    """'16,64,256': comma-separated whole numbers >= 1 (ValueError naming the flag)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} needs comma-separated whole numbers >= 1, got {text!r}")
    return values


def numbers(flag: str, text: str) -> list[float]:
    """'50,100,160': comma-separated finite numbers (ValueError naming the flag)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{flag} needs comma-separated numbers, got {text!r}")
    return values


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    value = int(_number(int, text))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535; got {text!r}")
    return value
