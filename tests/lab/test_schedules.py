"""moe_lib.lab.schedules: the models of the chained launch's tickets and of a Gluon launch's program order."""

import dataclasses

from moe_lib.lab import schedules
from moe_lib.swiglu_down.designs.chained import CHAINED_TILES
from moe_lib.swiglu_down.designs.gluon import FORMS, grad_down_in_second_launch, with_second
from moe_lib.swiglu_down.designs.triton_launches import launch_plan
from moe_lib.tiling import cdiv


def test_chained_schedule_keeps_every_sm_busy_with_one_tile_at_a_time():
    """The model of the chained launch's tickets: every program placed once, no two tiles on one SM at once,
    launch 2's tiles after the last dA tile, and the total work that of the plan's products."""
    T, H, I = 512, 2048, 768
    tiles = CHAINED_TILES[512]
    plan = launch_plan(T, H, I, tiles)
    for first in (False, True):
        schedule = schedules.chained_schedule(T, H, I, dataclasses.replace(tiles, grad_x_first=first))
        assert len(schedule) == sum(k.programs for k in plan)
        for _, rows in schedule.sort_values("start").groupby("sm"):
            assert (rows.start.to_numpy()[1:] >= rows.end.to_numpy()[:-1] - 1e-9).all()
        d_a_end = schedule[schedule.kind == "dA"].end.max()
        assert schedule[schedule.kind.isin(["dx", "dWg", "dWu"])].start.min() >= d_a_end
        work = (
            sum(2 * k.block_m * k.block_n * k.reduce_length * k.tiles * (2 if k.launch == 2 else 1) for k in plan) / 1e6
        )
        assert abs((schedule.end - schedule.start).sum() - work) < 1e-6 * work
    # the longest tiles first leave the shorter tail at 512 tokens
    spans = {
        first: schedules.chained_schedule(T, H, I, dataclasses.replace(tiles, grad_x_first=first)).end.max()
        for first in (False, True)
    }
    assert spans[True] < spans[False]
    # the dWd tiles last: the same work, after launch 2's tiles in the tickets; a shorter tail at 1321 tokens
    last = schedules.chained_schedule(1321, H, I, CHAINED_TILES[1153], grad_down_last=True)
    before = schedules.chained_schedule(1321, H, I, CHAINED_TILES[1153])
    assert abs((last.end - last.start).sum() - (before.end - before.start).sum()) < 1e-6 * last.end.sum()
    assert last[last.kind == "dWd"].start.min() >= last[last.kind.isin(["dx", "dWg", "dWu"])].start.min()
    assert last.end.max() < before.end.max()


def test_gluon_launch_schedule_places_every_tile_and_the_long_ones_first_shorten_the_tail():
    """The model of a Gluon launch's program order: every tile placed once, one at a time per SM, the work that of
    its products (launch 2's twice with the lo halves); with the long tiles first they start at 0 and, at 512 tokens
    on 64-row tiles, the launch ends sooner, in both launches."""
    T, H, I = 512, 2048, 768
    launch1, launch2 = FORMS["tall"].first, FORMS["tall"].second  # the faithful path's form at 257-512 tokens
    spans = {}
    for form, flag, long_kind in ((launch1, "d_a_first", "dA"), (launch2, "grad_x_first", "dx")):
        for first in (False, True):
            schedule = schedules.gluon_launch_schedule(T, H, I, dataclasses.replace(form, **{flag: first}))
            for _, rows in schedule.sort_values("start").groupby("sm"):
                assert (rows.start.to_numpy()[1:] >= rows.end.to_numpy()[:-1] - 1e-9).all()
            if form is launch1:
                tiles = {
                    "dWd": (cdiv(H, 64) * cdiv(I, 128), 64 * 128 * T),
                    "dA": (cdiv(T, 64) * cdiv(I, 128), 64 * 128 * H),
                }
            else:
                weight = (cdiv(I, 64) * cdiv(H, 256), 64 * 256 * T * 2)
                tiles = {"dWg": weight, "dWu": weight, "dx": (cdiv(T, 64) * cdiv(H, 256), 64 * 256 * 2 * I * 2)}
            assert schedule.kind.value_counts().to_dict() == {kind: n for kind, (n, _) in tiles.items()}
            work = sum(2 * n * multiply_adds for n, multiply_adds in tiles.values()) / 1e6
            assert abs((schedule.end - schedule.start).sum() - work) < 1e-6 * work
            assert (schedule[schedule.kind == long_kind].start.min() == 0) == first
            spans[long_kind, first] = schedule.end.max()
        assert spans[long_kind, True] < 0.85 * spans[long_kind, False], long_kind


def test_gluon_launch_schedule_places_grad_down_tiles_where_launch_2_takes_them():
    """With dWd's tiles in launch 2 the model of a launch puts them first (or after dWg's and dWu's), in their own
    width, and launch 1 has none; the work is the same products either way."""
    T, H, I = 8192, 2048, 768
    moved = grad_down_in_second_launch(FORMS["wide_da256"])  # the 3600-5199 band's form
    for name, config, width, after in (
        ("dWd 256 wide", moved, 256, False),
        ("dWd 128 wide", with_second(moved, grad_down_block_n=128), 128, False),
        ("dWd after dWg, dWu", with_second(moved, grad_down_after_weight_grad=True), 256, True),
    ):
        launch1 = schedules.gluon_launch_schedule(T, H, I, config.first)
        launch2 = schedules.gluon_launch_schedule(T, H, I, config.second)
        assert set(launch1.kind) == {"dA"}
        kinds = list(dict.fromkeys(launch2.kind))  # in program-id order
        assert kinds == (["dWg", "dWu", "dWd", "dx"] if after else ["dWd", "dWg", "dWu", "dx"]), name
        assert (launch2.kind == "dWd").sum() == cdiv(H, 128) * cdiv(I, width), name
        grad_down_work = ((launch2.end - launch2.start)[launch2.kind == "dWd"]).sum()
        assert abs(grad_down_work - 2 * H * I * T / 1e6) < 1e-6 * grad_down_work, name
