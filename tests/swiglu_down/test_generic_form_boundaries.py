"""P1's generic Gluon form (``choose.generic_gluon_form``: shapes no measured table covers) pinned at each rule's
boundary, at it and one off, in literals: the narrow form while T/64 · I/64 tiles are at most half the SMs (reached
exactly at I 704, T 384: 6 · 11 = 66), the tall form while T/128 · I/128 are fewer than half (66 at I 768, T 1281),
64-row dx tiles while T/128 · H/256 are fewer than the SMs, dx split over 4, 2 or 1 programs, and launch 2's
persistent weight-gradient programs only where they fit beside dx's."""

from __future__ import annotations

import dataclasses

import pytest

from moe_lib.swiglu_down.choose import generic_gluon_form
from moe_lib.swiglu_down.designs.gluon import FORMS

# (T, H, I, SMs) -> form, dx's splits, launch 2's persistent weight-gradient programs
TABLE = [
    ((128, 2048, 704, 132), ("narrow", 4, 68)),
    ((129, 2048, 704, 132), ("narrow", 2, 68)),
    ((256, 2048, 704, 132), ("narrow", 2, 68)),
    ((257, 2048, 704, 132), ("narrow", 1, 68)),
    ((383, 2048, 704, 132), ("narrow", 1, 68)),
    ((384, 2048, 704, 132), ("narrow", 1, 68)),  # 6 · 11 = 66 tiles: at half the SMs
    ((385, 2048, 704, 132), ("tall", 1, 68)),
    ((512, 2048, 704, 132), ("tall", 1, 68)),
    ((513, 2048, 704, 132), ("tall", 1, 0)),  # dx's programs and 68 more would not fit on 132 SMs
    ((320, 2048, 768, 132), ("narrow", 1, 68)),
    ((321, 2048, 768, 132), ("tall", 1, 68)),
    ((1280, 2048, 768, 132), ("tall", 1, 0)),
    ((1281, 2048, 768, 132), ("wide_tall", 1, 0)),  # 11 · 6 = 66 tiles: not fewer than half the SMs
    ((1282, 2048, 768, 132), ("wide_tall", 1, 0)),
    ((2048, 2048, 768, 132), ("wide_tall", 1, 0)),  # 16 · 8 = 128 dx tiles < 132
    ((2049, 2048, 768, 132), ("wide", 1, 0)),
    ((64, 4096, 1536, 132), ("narrow", 4, 68)),
    ((65, 4096, 1536, 132), ("narrow", 2, 68)),
    ((128, 4096, 1536, 132), ("narrow", 2, 68)),
    ((129, 4096, 1536, 132), ("tall", 1, 68)),
    ((1024, 1024, 256, 132), ("narrow", 1, 68)),
    ((1025, 1024, 256, 132), ("tall", 1, 0)),
]


def _form_name(form) -> str:
    """The name in FORMS of ``form``, launch 2's splits and persistent programs aside."""
    second = dataclasses.replace(form.second, grad_x_splits=1, weight_grad_programs=0)
    names = [
        name
        for name, known in FORMS.items()
        if known.first == form.first
        and dataclasses.replace(known.second, grad_x_splits=1, weight_grad_programs=0) == second
    ]
    assert len(names) == 1, names
    return names[0]


@pytest.mark.parametrize("shape, expected", TABLE, ids=lambda v: "-".join(map(str, v)))
def test_generic_form_at_each_boundary(shape, expected):
    form = generic_gluon_form(*shape)
    assert (_form_name(form), form.second.grad_x_splits, form.second.weight_grad_programs) == expected
